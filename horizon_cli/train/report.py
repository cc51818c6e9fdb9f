"""`horizon train --dry-run`: every check a real start makes (train/checks.py, in its order),
writing nothing, then the plan of this run and the ladder of every rung, printed (and as JSON with
--json). Where the start would stop, the plan is still printed and written, then the start's own
line ends the dry run with exit status 2 (errors.DryRunRefused, which carries the plan)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from ..config import Config, dump_yaml
from ..data import PreparedData
from ..engine.build import Planned, dropout_line
from ..errors import DryRunRefused, InputError
from ..fmt import fmt_bytes
from ..fsutil import write_text_atomic
from ..optim.modes import RUNG_MODES
from ..planning.fit import Machine
from ..planning.ladder import (
    HOW,
    REACH,
    PlannedModel,
    best_rung,
    fit_parts,
    fits,
    longest_by_rung,
    not_applicable,
)
from ..planning.memory import MemoryPlan
from ..planning.release import clipping_line, step_passes
from ..planning.tiling import note as tiling_note
from ..recipes.recipe import PlanModel
from ..recipes.registry import batches_for, recipe_for
from ..runtime.dtype import DtypeChoice
from ..store import Store
from .checks import before_claim, kernel_ready
from .inputs import NoTokenizerFiles, load_data
from .rundir import RunDir


def dry_run_report(
    planned: Planned,
    where: Machine,
    console: Console,
    json_out: Path | None,
    local: bool = True,
    dtype: DtypeChoice | None = None,
    release: str = "",
) -> dict:
    """The checks of a real start that write nothing: the data is read and tokenized (not
    cached, not even where data.cache_dir says), the run dir's resume point checked against
    this config. Then the plan of this run and the ladder of every rung on `where`.
    local: `where` is this machine (else --host-gib/--device-gib's: this device is not checked).
    dtype: how engine.dtype was decided, for this machine's device (shown, and in the JSON).
    release: how optim.grad_release: auto was decided (planning.release; "" where the config named it)."""
    cfg, model, rungs, chosen = planned.cfg, planned.model, planned.rungs, planned.rung
    refused, run_dir, data = None, None, None
    try:  # the start's checks, in its order (train/checks.py): the first that fails is its line
        before_claim(planned, where, local)
        run_dir, trained = run_dir_status(cfg, model)
        if not trained:
            data = check_data(cfg, model, console)
            kernel_ready(cfg.optim.kernel, console, build=False)
    except InputError as e:
        refused = e
    # soft_wrap: never crop a long line (a path) at the terminal's width; the config must read back
    yaml_text = Syntax(dump_yaml(cfg), "yaml", theme="ansi_dark", background_color="default")
    console.print(yaml_text, soft_wrap=True)
    plan, na = rungs[chosen], not_applicable(model)
    console.print(plan_table(plan, step_passes(cfg)))
    console.print(ladder_table(rungs, where, chosen, na))
    reach = longest_by_rung(cfg, model, planned.lora, planned.world, where)
    console.print(reach_line(reach, model.arch.max_positions, where, na), highlight=False, soft_wrap=True)
    console.print(f"sequence tiles: {tiling_note(model.arch)}", highlight=False, soft_wrap=True)
    if dtype is not None:  # the printed config says the resolved one; this line says why
        console.print(dtype.line, highlight=False, soft_wrap=True)
    clipping = clipping_line(cfg, plan)
    for line in (release, clipping):
        if line:
            console.print(line, highlight=False, soft_wrap=True)
    if drop := dropout_line(cfg, model.arch):
        console.print(drop, highlight=False, soft_wrap=True)
    ok, why = fits(plan, where)
    console.print(("[green]fits[/]: " if ok else "[red]does not fit[/]: ") + why, highlight=False)
    best = best_rung(rungs, where, na)
    if not ok:
        console.print(f"largest rung that fits: {best or 'none'}" + (f" ({HOW[best]})" if best else ""))
    if run_dir is not None:
        console.print(f"output.dir: {run_dir}", highlight=False)
    report = plan_json(model, rungs, chosen, where)
    report["longest_seq"] = reach  # tokens per rung (tiles as auto picks them, no layer kept)
    report["max_positions"] = model.arch.max_positions
    if dtype is not None:
        report["dtype"] = dtype.record()
    report["grad_release"] = {"value": cfg.optim.grad_release, "why": release, "clipping": clipping}
    if drop:
        report["dropout"] = drop
    # what runs between steps (rl's rollouts): the kept layers' graphs and weights (held from a
    # step's forward to its backward) are not on the device then, so their room is free
    free = None if where.device is None else max(0, where.device - (plan.device_total - plan.kept_bytes))
    quant = "nf4" if chosen == "qlora" else ""
    terms = recipe_for(cfg).plan(
        cfg, data, PlanModel(model.arch, cfg.engine.dtype, quant, free, planned.world.size)
    )
    for key, term in terms.items():  # the recipe's own (a reference pass, rollouts)
        console.print(term.pop("text"), highlight=False)
        report[key] = term
    if json_out is not None:
        write_json(json_out, report)
    if refused is not None:
        raise DryRunRefused(str(refused), report) from None
    return report


def check_data(cfg: Config, model: Store | PlannedModel, console: Console) -> PreparedData | None:
    """The data read and tokenized as a start would (None: not tokenized, no tokenizer files; a
    hub id's dry run fetches its config.json alone, so there the data needing a tokenizer is only
    noted: the converted store will hold the tokenizer)."""
    no_tokenizer = isinstance(model, PlannedModel) and not has_tokenizer(model.root)
    why = f"{model.name} holds no tokenizer files" if isinstance(model, PlannedModel) else ""
    if isinstance(model, PlannedModel) and model.hub:
        why = f"{model.hub}: a dry run fetches its config.json alone, and the cache holds no tokenizer files of it"
    if no_tokenizer and cfg.data.format not in ("tokens", "auto", "preference"):
        if isinstance(cfg.data.path, str) and not Path(cfg.data.path).exists():
            raise InputError(f"data.path: {cfg.data.where} not found")
        console.print(f"data: {cfg.data.where} not tokenized ({why})", highlight=False)
        return None
    try:
        data = load_data(replace(cfg, data=replace(cfg.data, cache_dir=None)), model, None, console)
    except NoTokenizerFiles:
        if not (isinstance(model, PlannedModel) and model.hub):
            raise
        console.print(f"data: {cfg.data.where} not tokenized ({why})", highlight=False)
        return None
    batches_for(cfg, data)  # the data goes with the config's method, which builds (rl: loads its rewards)
    return data


def has_tokenizer(d: Path) -> bool:
    return any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def run_dir_status(cfg: Config, model: Store | PlannedModel) -> tuple[str, bool]:
    """(what a start would do with output.dir, whether it is trained to train.steps: then the
    start only finishes it). The claim's checks and lines (RunDir.probe)."""
    path = Path(cfg.output.dir)
    store = model if isinstance(model, Store) else None
    probe = RunDir.probe(cfg, store, Console(quiet=True))
    if not probe.candidates:
        return f"{path}: a new run", False
    if store is None:
        return f"{path}: has checkpoints (resuming needs the converted store)", False
    if probe.trained:
        return f"{path}: complete at step {probe.resume_step}", True
    return f"{path}: resumes from {probe.candidates[0].name}", False


def plan_table(plan: MemoryPlan, passes: int = 1) -> Table:
    """passes: a step's forward and backward passes (planning.release.step_passes: 2 norm-first)."""
    title = f"memory plan ({plan.params:,} parameters)"
    if plan.trainable < plan.params:
        title = f"memory plan ({plan.params:,} parameters, LoRA: {plan.trainable:,} trained)"
    if plan.world > 1:
        title += f", per rank of {ranks_text(plan)}"
    t = Table(title=title, title_justify="left")
    t.add_column("where")
    t.add_column("category")
    t.add_column("bytes", justify="right")
    for k, v in plan.host.items():
        t.add_row("host", k, fmt_bytes(v))
    t.add_row("host", "[bold]total", f"[bold]{fmt_bytes(plan.host_total)}")
    if plan.world > 1:
        t.add_row(
            "host", f"[bold]per node[/] ({plan.per_node} ranks)", f"[bold]{fmt_bytes(plan.node_host_total)}"
        )
        t.add_row("host", f"all {plan.nodes} node(s)", fmt_bytes(plan.all_host_total))
    all_ranks = " (all ranks)" if plan.world > 1 else ""
    t.add_row("host", f"state bytes per parameter{all_ranks}", f"{plan.bytes_per_param:.2f}")
    for k, v in plan.device.items():
        t.add_row("device", k, fmt_bytes(v))
        if k == "layer working set" and plan.untiled_work and plan.seq_tile:
            more = v > plan.untiled_work  # a tile's own buffers outweigh what it saves: a hint
            hint = ", less: a smaller engine.seq_tile or auto plans below it" if more else ""
            t.add_row(
                "device",
                f"  (tiles of {plan.seq_tile:,} tokens; untiled it would be{hint})",
                fmt_bytes(plan.untiled_work),
            )
    t.add_row("device", "[bold]peak", f"[bold]{fmt_bytes(plan.device_total)}")
    t.add_row(
        "device",
        "kept layers (engine.keep_activations)",
        f"{plan.kept} of {plan.layers}, {passes * (2 * (plan.calls or plan.layers) - plan.kept)} layer loads "
        "per step"
        + (" (two passes: norm-first)" if passes > 1 else "")
        + (f" (a loop: {plan.loop})" if plan.loop else ""),
    )
    if plan.world > 1:
        t.add_row("device", f"per node ({plan.per_node} devices)", fmt_bytes(plan.node_device_total))
    return t


def reach_line(
    reach: dict[str, int], positions: int, where: Machine, na: dict[str, str] | None = None
) -> str:
    """The longest sequence each rung trains on `where` (ladder.longest_by_rung), in one line."""

    def one(rung: str, n: int) -> str:
        if rung in (na or {}):
            return f"{rung} n/a"
        tokens = "none fits" if not n else f"{n:,}" + ("+" if n >= REACH else "") + " tokens"
        return f"{rung} {tokens}" + (f" (positions: {positions:,})" if n > positions else "")

    return (
        f"longest trainable sequence on {where.what} (engine.seq_tile: auto, no layer kept): "
        + ", ".join(one(r, n) for r, n in reach.items())
        + f"; the model's positions: {positions:,}"
    )


def ranks_text(plan: MemoryPlan) -> str:
    return f"{plan.world} ranks ({plan.nodes} node(s) of {plan.per_node})"


def ladder_table(
    rungs: dict[str, MemoryPlan], where: Machine, chosen: str, na: dict[str, str] | None = None
) -> Table:
    """na: rungs the model cannot run (not_applicable): shown, their fit 'n/a'."""
    one = next(iter(rungs.values()))
    sharded = one.world > 1
    title = f"memory ladder on {where.what}" + (f", {ranks_text(one)}" if sharded else "")
    t = Table(title=title, title_justify="left")
    host, device = ("host per node", "device per rank") if sharded else ("host", "device")
    for col in ("rung", "trains", "host B/param", host, device, "kept layers", "fits"):
        t.add_column(col, justify="left" if col in ("rung", "trains", "fits") else "right")
    for rung, p in rungs.items():
        ok, _ = fits(p, where)
        mark = " [bold](this run)[/]" if rung == chosen else ""
        fit = "[green]yes[/]" if ok else "[red]no[/]"
        if rung in (na or {}):
            fit = "[yellow]n/a[/] (4-bit store)"
        t.add_row(
            rung + mark,
            WHAT[rung],
            f"{p.bytes_per_param:.2f}",
            fmt_bytes(p.node_host_total),
            fmt_bytes(p.device_total),
            str(p.kept),
            fit,
        )
    return t


WHAT = {
    **{m.name: m.what for m in RUNG_MODES.values()},
    "lora": "adapters, base frozen",
    "qlora": "adapters, NF4 base",
}


def plan_json(model: Store | PlannedModel, rungs: dict[str, MemoryPlan], chosen: str, where: Machine) -> dict:
    """host_bytes, device_bytes, host and device are one rank's (with one rank: the run's), as
    kept_layers (K, engine.keep_activations) and kept_bytes (what they hold on the device);
    host_bytes_per_param counts every rank's state; *_per_node and host_bytes_all_nodes add up
    the ranks of a node and of the world. A rung the model cannot run (not_applicable) has
    `applicable: false`, `fits: false` and `not_applicable` saying why; host_fits and
    device_fits still compare its plan with the machine."""
    na = not_applicable(model)

    def one(p: MemoryPlan, rung: str) -> dict:
        ok, host_ok, dev_ok = fit_parts(p, where)
        why = {"not_applicable": na[rung]} if rung in na else {}
        return {
            "params": p.params,
            "trainable_params": p.trainable,
            "host_bytes": p.host_total,
            "host_bytes_per_param": p.bytes_per_param,
            "device_bytes": p.device_total,
            "applicable": rung not in na,
            **why,
            "fits": ok and rung not in na,
            "host_fits": host_ok,
            "device_fits": dev_ok,
            "host_bytes_per_rank": p.host_total,
            "device_bytes_per_rank": p.device_total,
            "host_bytes_per_node": p.node_host_total,
            "device_bytes_per_node": p.node_device_total,
            "host_bytes_all_nodes": p.all_host_total,
            "grad_release": rung in RUNG_MODES and RUNG_MODES[rung].release,
            "kept_layers": p.kept,
            "kept_bytes": p.kept_bytes,
            "seq_tile": p.seq_tile,
            "layer_work_untiled_bytes": p.untiled_work,
        }

    plan = rungs[chosen]
    return {
        "model": model.name if isinstance(model, PlannedModel) else str(model.root),  # a hub id as given
        "memory": chosen,
        "world_size": plan.world,
        "nproc_per_node": plan.per_node,
        "nodes": plan.nodes,
        **one(plan, chosen),
        "host": plan.host,
        "device": plan.device,
        "machine": {"host_bytes": where.host, "device_bytes": where.device, "what": where.what},
        "ladder": {rung: one(p, rung) for rung, p in rungs.items()},
        "largest_rung_that_fits": best_rung(rungs, where, na),
    }


def write_json(path: Path, obj: dict) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1) + "\n")
