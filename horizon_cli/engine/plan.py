"""The memory plan: host and device bytes by category for a model and a run's settings.

Shown by `horizon inspect` and `horizon train --dry-run`, and used to refuse a run that cannot
fit in RAM. The engine reports its device usage with the same formulas on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arch import ArchSpec
from ..store import layouts
from .host import kind_numel, segments

ITEM = {"bfloat16": 2, "float32": 4}


@dataclass
class MemoryPlan:
    params: int
    trainable: int = 0  # parameters the run updates (LoRA: the adapters)
    host: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def state_bytes(self) -> int:
        """Host bytes that scale with the parameter count (everything but activations)."""
        return sum(v for k, v in self.host.items() if k not in ("saved activations", "staging"))

    @property
    def bytes_per_param(self) -> float:
        return self.state_bytes / max(1, self.params)


def layer_work_bytes(spec: ArchSpec, tokens: int, rows: int, T: int, item: int) -> int:
    """One layer's forward+backward working set for one micro-batch (tokens = rows * T)."""
    if spec.generic is not None:
        return generic_work_bytes(spec, tokens, rows, T, item)
    per_tok = 4 * spec.hidden + spec.q_dim + 2 * spec.kv_dim + 3 * spec.intermediate
    masked = any(w is not None and w < T for w in spec.windows)
    attn = rows * T * T if masked else 0  # the CPU's dense bool mask (CUDA: a flex block mask, far smaller)
    return 2 * tokens * per_tok * item + attn


def generic_work_bytes(spec: ArchSpec, tokens: int, rows: int, T: int, item: int) -> int:
    """The same estimate for a generic layer, read off its tensor table: every projection's output
    per token (a matrix (out, in): out; a routed expert tensor (E, a, b): top-k times the side that
    is not the hidden size), plus the residual stream and norms, held for the backward; attention
    scores where they are materialised (eager attention, or explicit masks: sliding windows)."""
    g = spec.generic
    assert g is not None
    moe, H = g.get("moe"), spec.hidden
    per_tok = 0
    for kind in set(g["layer_kinds"]):
        n = 4 * H
        for e in g["kinds"][kind]:
            shape = e["shape"]
            if moe and len(shape) == 3 and shape[0] == moe["n_experts"]:
                n += moe["top_k"] * (shape[1] if shape[2] == H else shape[2]) + H  # + gathered inputs
            elif len(shape) == 2:
                n += shape[0]
        per_tok = max(per_tok, n)
    masked = g["attn"] == "eager" or any(w is not None and w < T for w in spec.windows)
    attn = rows * spec.n_heads * T * T * (4 + item) if masked else 0  # fp32 softmax + its input
    return 2 * tokens * per_tok * item + attn


def head_work_bytes(spec: ArchSpec, tokens: int, chunk: int, item: int) -> int:
    """One logits chunk: compute-dtype logits, their fp32 copy and its gradient; and the chunk's
    LM-head weight gradient (vocab, hidden) in the compute dtype before it is added in fp32."""
    return min(chunk, tokens) * spec.vocab * (item + 8) + spec.vocab * spec.hidden * item


@dataclass(frozen=True)
class LoraPlan:
    """What the `lora` rungs assume (the `lora:` section's defaults; LoRA runs are planned with
    their own settings through `lora_bytes`)."""

    r: int = 16
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    base: str = "store"  # the frozen base's format: "store" (its dtype) or "nf4"


NF4_BYTES = 0.5 + 4 / 64  # 4-bit codes + an fp32 absmax per block of 64 (QLoRA, before double quantization)
ADAPTER_BYTES = 4 + 4 + 4 + 4  # per adapter parameter: fp32 master, m, v, gradient (exact AdamW)
RUNGS = ("exact", "lean", "lora", "qlora")  # the ladder, most exact first


def lora_targets(spec: ArchSpec, lp: LoraPlan) -> list[tuple[int, int]]:
    """(out, in) of every adapted matrix in the model: 2-D decoder-layer tensors whose HF module
    name is a target (PEFT's rule: the last component of the module path)."""
    out = []
    for lay in layouts(spec):
        if not lay.name.startswith("layer."):
            continue
        for p in lay.tensors:
            module = p.hf.rsplit(".", 2)[-2] if p.hf.endswith(".weight") else ""
            if p.trainable and len(p.shape) == 2 and module in lp.targets:
                out.append((p.shape[0], p.shape[1]))
    return out


def lora_bytes(spec: ArchSpec, lp: LoraPlan, store_item: int, item: int) -> tuple[dict[str, int], int]:
    """Host bytes by category of a LoRA run, and its adapter parameter count. The base is frozen:
    no master, moments or gradients; with `nf4`, decoder-layer matrices are 4-bit (embedding, head
    and norms stay in the store dtype). Adapters: r x (in + out) per target, trained exactly
    (ADAPTER_BYTES), plus their streaming copy. The LoRA engine decides where adapters live; this
    is the one function its plan needs to change."""
    lays = layouts(spec)
    adapters = sum(lp.r * (o + i) for o, i in lora_targets(spec, lp))
    host: dict[str, int] = {}
    if lp.base == "nf4":
        mats = sum(
            p.numel for lay in lays if lay.name.startswith("layer.") for p in lay.tensors if len(p.shape) >= 2
        )
        rest = sum(lay.numel for lay in lays) - mats
        host["base weights (nf4, frozen)"] = int(mats * NF4_BYTES)
        host["base weights (embedding, head, norms)"] = rest * store_item
    else:
        host["base weights (frozen)"] = sum(lay.numel for lay in lays) * store_item
    host["adapters (fp32 master + moments + grad)"] = adapters * ADAPTER_BYTES
    host["adapters (streaming copy)"] = adapters * item
    return host, adapters


def memory_plan(
    spec: ArchSpec,
    dtype: str = "bfloat16",
    grad_dtype: str = "auto",
    batch: int = 1,
    micro_batch: int = 1,
    seq: int = 2048,
    prefetch: int = 2,
    loss_chunk: int = 2048,
    memory: str = "exact",
    lora: LoraPlan | None = None,
) -> MemoryPlan:
    """memory: exact | lean | lora | qlora (the last two: LoRA on the store-dtype or NF4 base)."""
    item = ITEM[dtype]
    lays = {lay.name: lay for lay in layouts(spec)}
    params = sum(lay.params for lay in lays.values())
    layer_max = max(lay.numel for n, lay in lays.items() if n.startswith("layer."))
    head = lays["head"].numel + (lays["embed"].numel if spec.tie_embeddings else 0)
    acts = batch * seq * spec.hidden * item  # one layer's boundary activations, whole batch
    p = MemoryPlan(params, trainable=params)
    gitem = ITEM[dtype if grad_dtype == "auto" else grad_dtype]
    if memory in ("lora", "qlora"):
        lp = lora or LoraPlan(base="nf4" if memory == "qlora" else "store")
        p.host, p.trainable = lora_bytes(spec, lp, item, item)
    else:
        p.host = trained_host(lays, dtype, gitem, memory)
    p.host["saved activations"] = spec.n_layers * acts
    p.host["staging"] = 2 * acts
    if memory in ("lora", "qlora"):
        adapter_layer = p.trainable // max(1, spec.n_layers)
        p.device["weight buffers"] = (prefetch * layer_max + head) * item
        p.device["adapter gradients (fp32)"] = 2 * adapter_layer * 4
    else:
        p.device["weight buffers"] = (prefetch * layer_max + head) * item
        p.device["gradient accumulators"] = (2 * layer_max + head) * 4 + (
            2 * layer_max * gitem if gitem != 4 else 0
        )
    p.device["saved inputs in flight"] = prefetch * acts
    p.device["activations"] = 2 * acts
    tok = micro_batch * seq
    p.device["layer working set"] = layer_work_bytes(spec, tok, micro_batch, seq, item)
    p.device["loss head working set"] = head_work_bytes(spec, tok, loss_chunk, item)
    return p


def trained_host(lays: dict, dtype: str, gitem: int, memory: str) -> dict[str, int]:
    """Host state of full fine-tuning: exact (fp32 master + moments) or lean (engine/host.py)."""
    item = ITEM[dtype]
    numel = sum(lay.numel for lay in lays.values())
    grads = (numel - lays["embed"].numel) * gitem + lays["embed"].numel * 4
    host = {"weights (streaming copy)": numel * item}
    if memory == "lean":
        segs = [segments(lay, "lean") for lay in lays.values()]
        n_lean = sum(kind_numel(s, "lean") for s in segs)
        n_exact = sum(kind_numel(s, "exact") for s in segs)
        host["master correction (int8)"] = n_lean
        host["moments (8-bit + block scales)"] = n_lean * 2 + n_lean // 64 * 8
        host["1-D tensors: master remainder + fp32 moments"] = n_exact * 10
    else:
        if dtype == "bfloat16":
            host["master remainder (int16)"] = numel * 2
        host["AdamW moments (fp32)"] = numel * 8
    host[f"gradients ({'bf16' if gitem == 2 else 'fp32'})"] = grads
    return host
