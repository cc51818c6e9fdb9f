"""The forward-only models an rl run holds beside the trained one, in its plan: the reference (beta
> 0, full fine-tuning: the model's store again; LoRA's reference is its base with the adapters
off, nothing more) and each reward model (rl.rewards[i].model, its own store). Each is a
forward-only engine (engine.params.FrozenParams): on the host its streaming copy (state.frozen: a
store narrower than the compute dtype stays as stored where there is a link; NF4 layers packed),
one rank's piece; on the device its weight buffers for the whole run (runtime.loader: a ring of
engine.prefetch layer buffers, the head and a tied embedding as their own; a narrow copy's upcast
buffers, an NF4 store's dequantized layer). Their activations live only during their sweep,
between training steps, and are not added.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..arch import ArchSpec
from ..arch.reward import reward_of
from ..config import Config
from ..errors import InputError
from ..lora.sizes import base_bytes
from ..runtime.device import has_link
from ..runtime.dtype import resolve as resolve_dtype
from ..store import Store, layouts
from .host_state import frozen_stream, piece
from .memory import ITEM, MemoryPlan


def with_frozen_models(plan: MemoryPlan, cfg: Config, arch: ArchSpec, stream: str, memory: str) -> MemoryPlan:
    """`plan` with the host and device bytes of the run's forward-only models; arch / stream: the
    trained model's architecture and its frozen streaming dtype (planning.ladder.base_stream)."""
    rl = cfg.rl
    if rl is None:
        return plan
    e = resolve_dtype(cfg.engine, cfg.optim.mode)
    host, device = dict(plan.host), dict(plan.device)
    models: list[tuple[str, ArchSpec, str, str]] = []
    if rl.beta > 0 and memory not in ("lora", "qlora"):
        models.append(("reference", arch, stream, ""))
    for i, r in enumerate(rl.rewards):
        if r.model is not None:
            rm, _ = reward_store(r.model, f"rl.rewards[{i}].model")
            stored = str(rm.dtype).replace("torch.", "")
            models.append(
                (f"reward model {i}", rm.arch, frozen_stream(stored, e.dtype, has_link(cfg.engine)), rm.quant)
            )
    for name, a, s, quant in models:
        host[f"{name} (streaming copy)"] = frozen_host(a, s, quant, plan.world)
        device[f"{name} (weight buffers)"] = frozen_device(a, s, e.dtype, quant, e.prefetch, plan.world)
    return replace(plan, host=host, device=device)


def reward_store(path: str, where: str) -> tuple[Store, dict]:
    """A reward model's store and its marker (arch.reward), or one line: a checkpoint not yet
    converted, no store, a causal LM's store."""
    root = Path(path)
    if not (root / "manifest.json").is_file() and (root / "config.json").is_file():
        raise InputError(
            f"{where}: {path} is a Hugging Face checkpoint; convert it first "
            f"(horizon convert {path} STORE) and name the store"
        )
    try:
        store = Store.open(root)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    marker = reward_of(store.manifest.extra)
    if marker is None:
        raise InputError(
            f"{where}: {path} is a causal LM's store, not a reward model's (convert an "
            "XForSequenceClassification checkpoint)"
        )
    return store, marker


def frozen_host(arch: ArchSpec, stream: str, quant: str, world: int) -> int:
    """One rank's piece of a frozen model's streaming copy (NF4 layers: their packed bytes)."""
    if quant:
        return -(-sum(base_bytes(arch, stream, quant).values()) // world)
    return sum(piece(lay.numel, world) for lay in layouts(arch)) * ITEM[stream]


def frozen_device(arch: ArchSpec, stream: str, dtype: str, quant: str, prefetch: int, world: int) -> int:
    """A forward-only engine's device weight buffers for the run (module doc)."""
    base = base_bytes(arch, stream, quant, world)
    lays = {lay.name: lay for lay in layouts(arch)}
    own = ["head"] + (["embed"] if arch.tie_embeddings else [])
    layer = max(v for k, v in base.items() if k.startswith("layer."))
    out = prefetch * layer + sum(base[u] for u in own)
    widest = max(lay.numel for k, lay in lays.items() if k.startswith("layer."))
    if quant:  # one layer dequantized on the device
        out += widest * ITEM[dtype]
    if ITEM[stream] < ITEM[dtype]:  # a narrow copy's upcast buffers: a layer's and the head's
        out += ((0 if quant else widest) + sum(lays[u].numel for u in own)) * ITEM[dtype]
    return out
