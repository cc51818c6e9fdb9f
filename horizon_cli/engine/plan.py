"""The memory plan: host and device bytes by category for a model and a run's settings.

Shown by `horizon inspect` and `horizon train --dry-run`, and used to refuse a run that cannot
fit in RAM. The engine reports its device usage with the same formulas on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arch import ArchSpec
from ..store import layouts

ITEM = {"bfloat16": 2, "float32": 4}


@dataclass
class MemoryPlan:
    params: int
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
    """One logits chunk: compute-dtype logits, their fp32 copy and its gradient."""
    return min(chunk, tokens) * spec.vocab * (item + 8)


def memory_plan(
    spec: ArchSpec,
    dtype: str = "bfloat16",
    grad_dtype: str = "auto",
    batch: int = 1,
    micro_batch: int = 1,
    seq: int = 2048,
    prefetch: int = 2,
    loss_chunk: int = 2048,
) -> MemoryPlan:
    item = ITEM[dtype]
    lays = {lay.name: lay for lay in layouts(spec)}
    numel = sum(lay.numel for lay in lays.values())
    params = sum(lay.params for lay in lays.values())
    layer_max = max(lay.numel for n, lay in lays.items() if n.startswith("layer."))
    head = lays["head"].numel + (lays["embed"].numel if spec.tie_embeddings else 0)
    acts = batch * seq * spec.hidden * item  # one layer's boundary activations, whole batch
    p = MemoryPlan(params)
    p.host["weights (streaming copy)"] = numel * item
    if dtype == "bfloat16":
        p.host["master remainder (int16)"] = numel * 2
    p.host["AdamW moments (fp32)"] = numel * 8
    gitem = ITEM[dtype if grad_dtype == "auto" else grad_dtype]
    p.host[f"gradients ({'bf16' if gitem == 2 else 'fp32'})"] = (numel - lays["embed"].numel) * gitem + lays[
        "embed"
    ].numel * 4
    p.host["saved activations"] = spec.n_layers * acts
    p.host["staging"] = 2 * acts
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
