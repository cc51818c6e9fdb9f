"""`horizon train`: config -> checks -> run dir (lock, resume) -> data -> engine -> loop -> export.

Everything that can be checked before training is checked first, so that bad input exits 2
before anything is written: the config, the store, the device, the memory plan, the run dir and
whether this config may resume it, the data. `--dry-run` runs the same checks and writes nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table

from .. import owner, preflight
from ..arch import ArchSpec, read_hf_config, spec_from_hf
from ..config import Config, dump_yaml, load_config
from ..config.schema import LoraConfig
from ..data.prepare import check_lengths
from ..dist.launch import joined, rank_device, world_from_env
from ..dist.shard import check_world
from ..dist.topology import World, world_for
from ..engine.adapters import LoraSetup, lora_for
from ..engine.fit import RESERVE, Machine, check_device_fit, cuda_index
from ..engine.lora_plan import lora_memory_plan
from ..engine.plan import RUNGS, MemoryPlan, memory_plan
from ..errors import HorizonError, InputError, Terminated
from ..faults import phase
from ..fsutil import write_text_atomic
from ..inspect import fmt_bytes
from ..lora.targets import resolve_targets
from ..store import Store
from ..store import checkpoint as ckpt
from . import compat
from .loop import Trainer, load_data
from .metrics import tensorboard_writer
from .ranks import claim
from .rundir import RunDir


def run_training(
    config_path: Path,
    overrides: list[str],
    dry_run: bool = False,
    console: Console | None = None,
    json_out: Path | None = None,
    machine: tuple[float, float] | None = None,
    ranks: tuple[int | None, int | None] = (None, None),
):
    """machine: (host GiB, device GiB) of another machine to plan for (dry run only); ranks:
    (--world-size, --nproc-per-node) to plan for (dry run only; else torchrun's environment)."""
    console = console or Console()
    phase("startup")
    cfg = load_config(config_path, overrides)
    if machine is not None and not dry_run:
        raise InputError("--host-gib/--device-gib plan for another machine: use them with --dry-run")
    if ranks != (None, None) and not dry_run:
        raise InputError(
            "--world-size/--nproc-per-node plan a dry run for that many ranks: add --dry-run "
            "(a run takes its world size from torchrun)"
        )
    world = world_for(*ranks)
    check_world(cfg.train.batch_size, cfg.train.micro_batch_size, world.size)
    preflight.check_output_file(json_out, "--json")
    model = open_model(Path(cfg.model.path))
    if not dry_run and not isinstance(model, Store):
        raise InputError(
            f"model.path: {model.root} is an HF checkpoint, not a store: convert it first "
            f"(horizon convert {model.root} STORE); --dry-run plans it as it is"
        )
    # a resume needs no lora.init (it has its checkpoint): scan the run dir only when one is given
    needs_init = cfg.lora is not None and bool(cfg.lora.init)
    fresh = needs_init and not ckpt.intact(Path(cfg.output.dir))[0]
    lora = lora_for(cfg.lora, model, cfg.train.seed, read_init=fresh)  # checked before any write
    if lora is not None and lora.note and os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 speaks
        console.print(f"[yellow]warning:[/] {escape(lora.note)}", highlight=False)
    check_lengths(cfg.data, model.arch.max_positions)
    where = given_machine(*machine) if machine is not None else local_machine(cfg)
    chosen = run_rung(cfg, model)
    rungs = plan_ladder(cfg, model, lora, world)
    if dry_run:
        if os.environ.get("RANK", "0") != "0":  # under torchrun rank 0 reports for every rank
            console, json_out = Console(quiet=True), None
        return dry_run_report(cfg, model, rungs, chosen, where, console, json_out)
    assert isinstance(model, Store)
    check_device_fit(rungs[chosen], cfg.engine)  # the device: lower the micro-batch, not the rung
    check_fits(rungs, chosen, where, not_applicable(model))
    cfg, console = join_world(cfg, console)
    if cfg.log.tensorboard:
        tensorboard_writer(None)  # fail now, not after loading the model
    with stop_signals(), joined(cfg.engine.device) as d, claim(cfg, model, console, d) as rd:
        phase("locked")
        if rd.finished():
            console.print(
                f"{rd.path}: complete at step {rd.resume_step} (train.steps {cfg.train.steps}); nothing to do",
                highlight=False,
            )
            return {"step": rd.resume_step, "checkpoint": str(rd.candidates[0]), "complete": True}
        with runtime_failures():
            return Trainer(cfg, model, rd, console, lora, dist=d).run()


def join_world(cfg: Config, console: Console) -> tuple[Config, Console]:
    """Under torchrun (WORLD_SIZE > 1): check the batch splits, put this rank on its own GPU
    (cuda:LOCAL_RANK), and let only rank 0 print."""
    world, rank, local = world_from_env()
    if world == 1:
        return cfg, console
    check_world(cfg.train.batch_size, cfg.train.micro_batch_size, world)
    cfg = replace(cfg, engine=replace(cfg.engine, device=rank_device(cfg.engine.device, local)))
    return cfg, console if rank == 0 else Console(quiet=True)


@dataclass
class PlannedModel:
    """A model known only by its config.json (an HF checkpoint dir, or that file alone): enough
    to plan and to dry-run, not to train. Its architecture is read as `convert` reads it."""

    root: Path
    arch: ArchSpec
    quant: str = ""  # an HF checkpoint is planned as converted without --quantize

    @property
    def hf_dir(self) -> Path:  # where its tokenizer files would be (train.loop.load_tokenizer)
        return self.root


def open_model(path: Path) -> Store | PlannedModel:
    if (path / "manifest.json").is_file() or not (path / "config.json").is_file():
        return Store.open(path)  # a store, or the store's own error for what is neither
    return PlannedModel(path, spec_from_hf(read_hf_config(path), where=str(path / "config.json")))


def run_rung(cfg: Config, model: Store | PlannedModel) -> str:
    """The ladder's rung this config runs on."""
    if cfg.lora is not None:
        return "qlora" if model.quant else "lora"
    return cfg.optim.memory


def plan_for(
    cfg: Config,
    spec: ArchSpec | Store | PlannedModel,
    memory: str,
    lora: LoraSetup | None = None,
    world: World = World(),
) -> MemoryPlan:
    """The memory plan of one rung of the ladder for this config, one rank's of `world`. The
    lora rungs are planned with the run's own adapters (`lora`), or, for a full fine-tuning
    config, lora:'s defaults."""
    spec = spec if isinstance(spec, ArchSpec) else spec.arch
    e = cfg.engine
    seq = min(cfg.data.max_seq_len, spec.max_positions)
    if memory in ("lora", "qlora"):
        targets, r = (lora.targets, lora.r) if lora else default_adapters(spec)
        return lora_memory_plan(
            spec,
            targets,
            r,
            e.dtype,
            e.grad_dtype,
            batch=cfg.train.batch_size,
            micro_batch=cfg.train.micro_batch_size,
            seq=seq,
            prefetch=e.prefetch,
            loss_chunk=e.loss_chunk,
            quant="nf4" if memory == "qlora" else "",
            world=world.size,
            per_node=world.per_node,
        )
    dtype = "bfloat16" if memory == "lean" else e.dtype  # lean keeps a bf16 weight
    return memory_plan(
        spec,
        dtype,
        e.grad_dtype if memory != "lean" else "auto",
        batch=cfg.train.batch_size,
        micro_batch=cfg.train.micro_batch_size,
        seq=seq,
        prefetch=e.prefetch,
        loss_chunk=e.loss_chunk,
        memory=memory,
        world=world.size,
        per_node=world.per_node,
    )


def plan_ladder(
    cfg: Config, spec: ArchSpec | Store | PlannedModel, lora: LoraSetup | None = None, world: World = World()
) -> dict[str, MemoryPlan]:
    return {rung: plan_for(cfg, spec, rung, lora, world) for rung in RUNGS}


def not_applicable(model: Store | PlannedModel) -> dict[str, str]:
    """The rungs this model cannot run, with why. A 4-bit store holds its decoder layers only in
    NF4: it cannot be fully fine-tuned, nor be a LoRA run's bf16 base (a lora: section on it runs
    qlora). Their plans are still shown, as what the model would need converted without
    --quantize."""
    if not model.quant:
        return {}
    full = f"a 4-bit ({model.quant}) store cannot be fully fine-tuned"
    lora = f"the store's base is 4-bit ({model.quant}): a lora: section on it runs qlora"
    return {"exact": full, "lean": full, "lora": lora}


def default_adapters(spec: ArchSpec) -> tuple[list, int]:
    """lora:'s default targets and r on this model (all its linear layers where the default
    names do not occur, e.g. fused attention)."""
    d = LoraConfig()
    try:
        return resolve_targets(d.targets, spec), d.r
    except InputError:
        return resolve_targets("all-linear", spec), d.r


# -- the machine ---------------------------------------------------------------------------------
def local_machine(cfg: Config) -> Machine:
    """What this process may allocate, and the configured device (checked to exist)."""
    device = preflight.check_device(cfg.engine)
    avail, limit = preflight.host_available()
    if not device.startswith("cuda"):
        return Machine(avail, None, f"this machine ({limit}), device {device}")
    import torch

    free, total = torch.cuda.mem_get_info(cuda_index(device))
    return Machine(
        avail, free, f"this machine ({limit}), {device} with {fmt_bytes(free)} of {fmt_bytes(total)} free"
    )


def given_machine(host_gib: float, device_gib: float) -> Machine:
    if not all(math.isfinite(g) and g > 0 for g in (host_gib, device_gib)):  # nan, inf: no machine
        raise InputError(
            f"--host-gib/--device-gib: give both, as positive finite numbers of GiB (got {host_gib:g}, {device_gib:g})"
        )
    host, dev = int(host_gib * 2**30), int(device_gib * 2**30)
    return Machine(host, dev, f"a machine with {fmt_bytes(host)} of RAM and a {fmt_bytes(dev)} CUDA device")


# -- dry run -------------------------------------------------------------------------------------
def dry_run_report(
    cfg: Config,
    model: Store | PlannedModel,
    rungs: dict[str, MemoryPlan],
    chosen: str,
    where: Machine,
    console: Console,
    json_out: Path | None,
) -> dict:
    """The checks of a real start that write nothing: the data is read and tokenized (not
    cached, not even where data.cache_dir says), the run dir's resume point checked against
    this config. Then the plan of this run and the ladder of every rung on `where`."""
    check_data(cfg, model, console)
    run_dir = run_dir_status(cfg, model)
    # soft_wrap: never crop a long line (a path) at the terminal's width; the config must read back
    yaml_text = Syntax(dump_yaml(cfg), "yaml", theme="ansi_dark", background_color="default")
    console.print(yaml_text, soft_wrap=True)
    plan, na = rungs[chosen], not_applicable(model)
    console.print(plan_table(plan))
    console.print(ladder_table(rungs, where, chosen, na))
    ok, why = fits(plan, where)
    console.print(("[green]fits[/]: " if ok else "[red]does not fit[/]: ") + why, highlight=False)
    best = best_rung(rungs, where, na)
    if not ok:
        console.print(f"largest rung that fits: {best or 'none'}" + (f" ({HOW[best]})" if best else ""))
    console.print(f"output.dir: {run_dir}", highlight=False)
    report = plan_json(model, rungs, chosen, where)
    if json_out is not None:
        write_json(json_out, report)
    return report


def check_data(cfg: Config, model: Store | PlannedModel, console: Console) -> None:
    no_tokenizer = isinstance(model, PlannedModel) and not has_tokenizer(model.root)
    if no_tokenizer and cfg.data.format not in ("tokens", "auto"):
        if not Path(cfg.data.path).exists():
            raise InputError(f"data.path: {cfg.data.path} not found")
        console.print(f"data: {cfg.data.path} not tokenized ({model.root} holds no tokenizer files)")
        return
    load_data(replace(cfg, data=replace(cfg.data, cache_dir=None)), model, None, console)


def has_tokenizer(d: Path) -> bool:
    return any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def run_dir_status(cfg: Config, model: Store | PlannedModel) -> str:
    path = Path(cfg.output.dir)
    compat.check_accept_keys(cfg)
    holder = owner.probe(path)
    if holder:
        return f"{path} is in use by {holder}: a real start would stop here"
    good, _ = ckpt.intact(path)
    if not good:
        return f"{path}: a new run"
    if not isinstance(model, Store):
        return f"{path}: has checkpoints (resuming needs the converted store)"
    probe = RunDir(cfg, model, Console(quiet=True))
    probe.candidates = good
    probe.check_resumable(good[0])
    if probe.trained:
        return f"{path}: complete at step {probe.resume_step}"
    return f"{path}: resumes from {good[0].name}"


def plan_table(plan: MemoryPlan) -> Table:
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
    t.add_row("device", "[bold]peak", f"[bold]{fmt_bytes(plan.device_total)}")
    if plan.world > 1:
        t.add_row("device", f"per node ({plan.per_node} devices)", fmt_bytes(plan.node_device_total))
    return t


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
    for col in ("rung", "trains", "host B/param", host, device, "fits"):
        t.add_column(col, justify="left" if col in ("rung", "trains", "fits") else "right")
    for rung, p in rungs.items():
        ok, _ = fits(p, where)
        mark = " [bold](this run)[/]" if rung == chosen else ""
        fit = "[green]yes[/]" if ok else "[red]no[/]"
        if rung in (na or {}):
            fit = "[yellow]n/a[/] (4-bit store)"
        t.add_row(rung + mark, WHAT[rung], f"{p.bytes_per_param:.2f}", fmt_bytes(p.node_host_total),
                  fmt_bytes(p.device_total), fit)  # fmt: skip
    return t


WHAT = {
    "exact": "all weights, fp32 state",
    "lean": "all weights, 8-bit state",
    "lora": "adapters, base frozen",
    "qlora": "adapters, NF4 base",
}
HOW = {
    "exact": "optim.memory: exact",
    "lean": "optim.memory: lean",
    "lora": "a lora: section",
    "qlora": "a lora: section on a `convert --quantize nf4` store",
}


def plan_json(model: Store | PlannedModel, rungs: dict[str, MemoryPlan], chosen: str, where: Machine) -> dict:
    """host_bytes, device_bytes, host and device are one rank's (with one rank: the run's);
    host_bytes_per_param counts every rank's state; *_per_node and host_bytes_all_nodes add up
    the ranks of a node and of the world. A rung the model cannot run (not_applicable) has
    `applicable: false`, `fits: false` and `not_applicable` saying why; host_fits and
    device_fits still compare its plan with the machine."""
    na = not_applicable(model)

    def one(p: MemoryPlan, rung: str) -> dict:
        ok, host_ok, dev_ok = fit_parts(p, where)
        why = {"not_applicable": na[rung]} if rung in na else {}
        return {"params": p.params, "trainable_params": p.trainable, "host_bytes": p.host_total,
                "host_bytes_per_param": p.bytes_per_param, "device_bytes": p.device_total,
                "applicable": rung not in na, **why,
                "fits": ok and rung not in na, "host_fits": host_ok, "device_fits": dev_ok,
                "host_bytes_per_rank": p.host_total, "device_bytes_per_rank": p.device_total,
                "host_bytes_per_node": p.node_host_total, "device_bytes_per_node": p.node_device_total,
                "host_bytes_all_nodes": p.all_host_total}  # fmt: skip

    plan = rungs[chosen]
    return {
        "model": str(model.root),
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


# -- host memory ---------------------------------------------------------------------------------
def fit_parts(plan: MemoryPlan, where: Machine) -> tuple[bool, bool, bool]:
    """(fits, host fits, device fits): a node's host bytes against the machine's RAM, a rank's
    device bytes against one device. With the device in host RAM (`device: cpu`) both count
    against the host; a CUDA device keeps RESERVE for its own use."""
    if where.device is None:
        ok = plan.node_host_total + plan.node_device_total <= where.host
        return ok, ok, True
    host_ok = plan.node_host_total <= where.host
    dev_ok = plan.device_total + RESERVE <= where.device
    return host_ok and dev_ok, host_ok, dev_ok


def fits(plan: MemoryPlan, where: Machine) -> tuple[bool, str]:
    ok, host_ok, dev_ok = fit_parts(plan, where)
    node = f" per node ({plan.per_node} ranks)" if plan.world > 1 else ""
    if where.device is None:
        need = plan.node_host_total + plan.node_device_total
        return (
            ok,
            f"host + device (both in RAM){node} needs {fmt_bytes(need)}, {fmt_bytes(where.host)} available ({where.what})",
        )
    return ok, (
        f"host{node} needs {fmt_bytes(plan.node_host_total)} of {fmt_bytes(where.host)}, "
        f"device{' per rank' if plan.world > 1 else ''} {fmt_bytes(plan.device_total)} "
        f"+ {fmt_bytes(RESERVE)} reserve of {fmt_bytes(where.device)} ({where.what})"
    )


def best_rung(rungs: dict[str, MemoryPlan], where: Machine, na: dict[str, str] | None = None) -> str | None:
    """The most exact rung that fits (the ladder is ordered), of those the model can run."""
    return next((r for r, p in rungs.items() if r not in (na or {}) and fit_parts(p, where)[0]), None)


def check_fits(
    rungs: dict[str, MemoryPlan], memory: str, where: Machine, na: dict[str, str] | None = None
) -> None:
    ok, why = fits(rungs[memory], where)
    if ok:
        return
    ladder = "; ".join(
        f"{r} {p.bytes_per_param:.2f} B/param, host{' per node' if p.world > 1 else ''} "
        f"{fmt_bytes(p.node_host_total)}, "
        + ("n/a" if r in (na or {}) else "fits" if fit_parts(p, where)[0] else "no")
        for r, p in rungs.items()
    )
    best = best_rung(rungs, where, na)
    hint = f"the largest rung that fits: {best} ({HOW[best]})" if best else "no rung fits"
    raise InputError(
        f"memory plan does not fit this machine: {why}. Ladder: {ladder}. {hint} "
        "(see `horizon train CONFIG --dry-run`)"
    )


# -- stopping ------------------------------------------------------------------------------------
@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM stops the run like SIGINT: an exception unwinds it (temp dirs removed, the last
    checkpoint kept) and the command exits 143."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise Terminated()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def runtime_failures() -> Iterator[None]:
    """Failures of the machine while training (a full disk, no memory, no threads) are one
    `error:` line and exit status 1, not a traceback."""
    try:
        yield
    except HorizonError:
        raise
    except MemoryError:
        raise HorizonError("out of host memory (MemoryError); the last checkpoint is intact") from None
    except OSError as e:
        raise HorizonError(f"{e.filename or 'I/O'}: {e.strerror or e}") from None
    except RuntimeError as e:
        if "can't start new thread" in str(e):
            raise HorizonError(f"cannot start a thread ({e}); the last checkpoint is intact") from None
        if "out of memory" in str(e).lower():
            raise HorizonError(f"{str(e).splitlines()[0]}; the last checkpoint is intact") from None
        raise
