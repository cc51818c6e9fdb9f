"""The memory ladder: one plan per way of training (exact, lean, lora, qlora) for a config, and
which of them fit a machine. `horizon train --dry-run` prints it, a start is refused with it.

The model may be a store or only an HF config.json (`PlannedModel`: planned as `convert` would
read it). Plans are one rank's of `world` (planning.memory, lora.sizes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from ..arch import ArchSpec, read_hf_config, spec_from_hf
from ..arch.reward import classifier, not_a_policy, scorer_class
from ..config import Config
from ..config.schema import LoraConfig
from ..convert.hub import fetch_config, hub_id
from ..errors import InputError
from ..fmt import fmt_bytes
from ..lora.setup import LoraSetup
from ..lora.sizes import adapter_work_bytes, lora_memory_plan
from ..lora.targets import resolve_targets
from ..optim.modes import RUNG_MODES, memory_mode
from ..parallel.topology import World
from ..runtime.device import has_link
from ..runtime.dtype import resolve as resolve_dtype
from ..store import Store
from .fit import RESERVE, Machine
from .frozen_models import with_frozen_models
from .keep import keep_plan
from .memory import ITEM, RUNGS, MemoryPlan, frozen_stream, memory_plan
from .tiling import STEP, longest, slack, with_tile
from .tiling import resolve as resolve_tile


@dataclass
class PlannedModel:
    """A model known only by its config.json (an HF checkpoint dir, that file alone, or a hub id's
    config.json in the Hugging Face cache): enough to plan and to dry-run, not to train. Its
    architecture is read as `convert` reads it."""

    root: Path
    arch: ArchSpec
    quant: str = ""  # an HF checkpoint is planned as converted without --quantize
    hub: str = ""  # the hub id it was fetched for (root: its cached snapshot)

    @property
    def hf_dir(self) -> Path:  # where its tokenizer files would be (train.loop.load_tokenizer)
        return self.root

    @property
    def name(self) -> str:
        return self.hub or str(self.root)


def open_model(path: str | Path, fetch: bool = True) -> Store | PlannedModel:
    """model.path: a store, an HF checkpoint dir or its config.json's dir, or a hub id (fetch:
    its config.json alone into the Hugging Face cache; without fetch it is refused: a start needs
    a store)."""
    repo = hub_id(path)
    if repo is not None:
        if not fetch:
            raise InputError(
                f"model.path: {repo} is no local directory, and as a Hugging Face Hub id not a store: "
                f"convert it first (horizon convert {repo} STORE); --dry-run plans it from its config.json"
            )
        try:
            root = fetch_config(repo)
        except InputError as e:
            raise InputError(f"model.path: {e} (there is no local directory {repo})") from None
        return PlannedModel(
            root, spec_from_hf(read_hf_config(root), where=str(root / "config.json")), hub=repo
        )
    path = Path(path)
    if (path / "manifest.json").is_file() or not (path / "config.json").is_file():
        store = Store.open(path)  # a store, or the store's own error for what is neither
        not_a_policy(scorer_class(store.manifest.extra), f"model.path: {path}")
        return store
    cfg = read_hf_config(path)
    not_a_policy(classifier(cfg), f"model.path: {path}")
    return PlannedModel(path, spec_from_hf(cfg, where=str(path / "config.json")))


def run_rung(cfg: Config, model: Store | PlannedModel) -> str:
    """The ladder's rung this config runs on."""
    if cfg.lora is not None:
        return "qlora" if model.quant else "lora"
    return cfg.optim.mode.name  # with optim.grad_release: true its release rung (auto reads as off)


def plan_for(
    cfg: Config,
    spec: ArchSpec | Store | PlannedModel,
    memory: str,
    lora: LoraSetup | None = None,
    world: World = World(),
    where: Machine | None = None,
) -> MemoryPlan:
    """The memory plan of one rung of the ladder for this config, one rank's of `world`, with
    its kept layers (engine.keep_activations; `auto` fits them to `where`, none without it). The
    lora rungs are planned with the run's own adapters (`lora`), or, for a full fine-tuning
    config, lora:'s defaults."""
    tiled = tile_plan(cfg, spec, memory, lora, world, where, cfg.engine.seq_tile)
    arch = spec if isinstance(spec, ArchSpec) else spec.arch
    stream = base_stream(cfg, spec, resolve_dtype(cfg.engine, cfg.optim.mode).dtype)
    tiled = with_frozen_models(tiled, cfg, arch, stream, memory)  # an rl run's reference, reward models
    return keep_plan(tiled, cfg.engine.keep_activations, where)


def tile_plan(
    cfg: Config, spec, memory: str, lora, world: World, where: Machine | None, setting
) -> MemoryPlan:
    """The rung's plan (no kept layers) with its sequence tile (engine.seq_tile, planning.tiling)."""
    arch = spec if isinstance(spec, ArchSpec) else spec.arch
    plan = _plan(cfg, spec, memory, lora, world)
    rows = cfg.train.micro_batch_size * cfg.rows_per_example
    seq = min(cfg.data.max_seq_len, arch.max_positions)
    e = resolve_dtype(cfg.engine, cfg.optim.mode)
    item = ITEM[e.dtype]  # activations: the compute dtype (lean's bf16 weight is upcast per layer)
    adapters = None
    if memory in ("lora", "qlora"):
        targets, r = (lora.targets, lora.r) if lora else default_adapters(arch)
        adapters = partial(adapter_work_bytes, targets, r, rows * seq, item, spec=arch)
    at = partial(with_tile, plan, arch, tokens=rows * seq, rows=rows, T=seq, item=item, adapters=adapters)
    return resolve_tile(setting, at, rows * seq, where)


def longest_seq(
    cfg: Config, spec: ArchSpec, memory: str, lora: LoraSetup | None, world: World, where: Machine, hi: int
) -> int:
    """The longest data.max_seq_len (a multiple of planning.tiling.STEP, at most hi) whose plan on
    this rung fits `where`, tiles chosen as engine.seq_tile: auto does, no layer kept."""
    big = replace(spec, max_positions=max(hi, spec.max_positions))

    def fits_at(seq: int) -> bool:
        c = replace(cfg, data=replace(cfg.data, max_seq_len=seq))
        return slack(tile_plan(c, big, memory, lora, world, where, "auto"), where) >= 0

    return longest(fits_at, STEP, hi)


def base_stream(cfg: Config, model, dtype: str) -> str:
    """A frozen base's streaming dtype (state.frozen): a store narrower than the compute dtype is
    held and moved as stored where there is a link, upcast on the device; else the compute dtype.
    A model known by its config.json alone is planned as `convert` writes it (bfloat16)."""
    if isinstance(model, Store):
        stored = str(model.dtype).replace("torch.", "")
    else:
        stored = "bfloat16" if isinstance(model, PlannedModel) else dtype
    return frozen_stream(stored, dtype, has_link(cfg.engine))


def _plan(cfg: Config, spec, memory: str, lora: LoraSetup | None, world: World) -> MemoryPlan:
    model = spec
    spec = spec if isinstance(spec, ArchSpec) else spec.arch
    e = resolve_dtype(cfg.engine, cfg.optim.mode)  # resolved already by train (the dry run's plan)
    seq = min(cfg.data.max_seq_len, spec.max_positions)
    rows = cfg.rows_per_example  # a preference pair is two sequences in the same micro-batch (rl: 1)
    if memory in ("lora", "qlora"):
        targets, r = (lora.targets, lora.r) if lora else default_adapters(spec)
        return lora_memory_plan(
            spec,
            targets,
            r,
            e.dtype,
            e.grad_dtype,
            batch=cfg.step_sequences,
            micro_batch=cfg.train.micro_batch_size * rows,  # rl: completions
            seq=seq,
            prefetch=e.prefetch,
            loss_chunk=e.loss_chunk,
            quant="nf4" if memory == "qlora" else "",
            world=world.size,
            per_node=world.per_node,
            dropout=lora.cfg.dropout if lora else 0.0,
            stream=base_stream(cfg, model, e.dtype),
        )
    mode = memory_mode(memory)
    return memory_plan(  # lean keeps a bf16 weight whatever it computes in (upcast per layer)
        spec,
        e.dtype,
        mode.rung_grad_dtype(e.grad_dtype),
        batch=cfg.step_sequences,
        micro_batch=cfg.train.micro_batch_size * rows,  # rl: completions
        seq=seq,
        prefetch=e.prefetch,
        loss_chunk=e.loss_chunk,
        memory=mode,
        world=world.size,
        per_node=world.per_node,
    )


def plan_ladder(
    cfg: Config,
    spec: ArchSpec | Store | PlannedModel,
    lora: LoraSetup | None = None,
    world: World = World(),
    where: Machine | None = None,
) -> dict[str, MemoryPlan]:
    return {rung: plan_for(cfg, spec, rung, lora, world, where) for rung in RUNGS}


def not_applicable(model: Store | PlannedModel) -> dict[str, str]:
    """The rungs this model cannot run, with why. A 4-bit store holds its decoder layers only in
    NF4: it cannot be fully fine-tuned, nor be a LoRA run's bf16 base (a lora: section on it runs
    qlora). Their plans are still shown, as what the model would need converted without
    --quantize."""
    if not model.quant:
        return {}
    full = f"a 4-bit ({model.quant}) store cannot be fully fine-tuned"
    lora = f"the store's base is 4-bit ({model.quant}): a lora: section on it runs qlora"
    return {**dict.fromkeys(RUNG_MODES, full), "lora": lora}


# id(spec) -> (spec, its default adapters): a dry run's longest-sequence search plans the lora rungs
# dozens of times on one spec, and resolving the targets builds the model on the meta device
_adapters: dict[int, tuple[ArchSpec, tuple[list, int]]] = {}


def default_adapters(spec: ArchSpec) -> tuple[list, int]:
    """lora:'s default targets and r on this model (all its linear layers where the default
    names do not occur, e.g. fused attention); resolved once per spec (the last few held)."""
    if id(spec) not in _adapters:
        while len(_adapters) >= 8:
            _adapters.pop(next(iter(_adapters)))
        _adapters[id(spec)] = (spec, _default_adapters(spec))
    return _adapters[id(spec)][1]


def _default_adapters(spec: ArchSpec) -> tuple[list, int]:
    d = LoraConfig()
    for targets in (d.targets, "all-linear"):
        try:
            return resolve_targets(targets, spec), d.r
        except InputError:
            continue
    return [[] for _ in range(spec.n_layers)], d.r  # no nn.Linear to adapt (GPT-2's Conv1D): the base alone


HOW = {
    **{m.name: m.how for m in RUNG_MODES.values()},
    "lora": "a lora: section",
    "qlora": "a lora: section on a `convert --quantize nf4` store",
}


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
    kept = rungs[memory]
    if kept.kept:
        hint += (
            f"; this plan keeps {kept.kept} layers ({fmt_bytes(kept.kept_bytes)}): lower "
            "engine.keep_activations, or set it to auto (as many as fit)"
        )
    raise InputError(
        f"memory plan does not fit this machine: {why}. Ladder: {ladder}. {hint} "
        "(see `horizon train CONFIG --dry-run`)"
    )


REACH = 1 << 24  # the longest sequence the dry run looks for (16,777,216 tokens)


def longest_by_rung(
    cfg: Config, model: Store | PlannedModel, lora: LoraSetup | None, world: World, where: Machine
) -> dict[str, int]:
    """Per rung of the ladder: the longest sequence its plan fits on `where` (longest_seq), the
    model's positions aside (the dry run says which bound binds)."""
    return {r: longest_seq(cfg, model.arch, r, lora, world, where, REACH) for r in RUNGS}
