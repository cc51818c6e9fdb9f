"""The memory plan of a LoRA run (the `lora` rung): a frozen base, adapters with full state.

Host: the base's streaming copy only (bf16: 2 B/param; NF4 layers: 0.5 B/param plus 1/64 B of
scales, embedding and head in the compute dtype), and per adapter parameter the state of a trained
unit (streaming copy, bf16 master remainder, AdamW moments, gradient). Device: `prefetch` layer
buffers (packed bytes for NF4) and one dequantized layer, a layer's adapters with each buffer,
their fp32 gradient accumulators, and the activations as in full fine-tuning (planning/memory.py).

With `world` ranks the frozen base is sharded as full fine-tuning's state is (a rank's host holds
the largest piece of every unit's streaming bytes; the device all-gathers whole layers), while the
adapters and their state are replicated on every rank: they are small, their gradients are
all-reduced in place, and every rank applies the same AdamW step to its copy.
"""

from __future__ import annotations

from ..arch import ArchSpec
from ..arch.tiling import block_prefixes
from ..planning.memory import (
    ITEM,
    MemoryPlan,
    gather_pad,
    head_work_bytes,
    kept_graph_bytes,
    layer_vectors,
    layer_work_bytes,
    piece,
    rank_batch,
    with_loop,
)
from ..planning.transients import backward_transient_bytes
from ..store import layouts
from ..store.packed import packed_layout, packs
from .targets import Target, adapter_params


def base_bytes(spec: ArchSpec, dtype: str, quant: str = "", world: int = 1) -> dict[str, int]:
    """Streaming bytes per unit of the frozen base (NF4 layers packed; scales in `dtype`). world:
    the bytes of a unit's whole device buffer in a sharded run instead (every rank's piece padded
    to the largest: a packed unit is split as bytes, any other in elements)."""
    item = ITEM[dtype]
    out = {}
    for lay in layouts(spec):
        if packs(lay.name, quant):
            n = packed_layout(spec, lay, item, quant).nbytes
            out[lay.name] = n + gather_pad(n, world)
        else:
            out[lay.name] = (lay.numel + gather_pad(lay.numel, world)) * item
    return out


def adapter_work_bytes(
    targets: list[list[Target]], r: int, tokens: int, item: int, tile: int = 0, spec: ArchSpec | None = None
) -> int:
    """What the adapters add to one layer's working set for one micro-batch: per token and adapted
    linear, A's output (r) and B's (out features), held for the add and the backward. tile
    (engine.seq_tile; spec given): those inside the layer's token-local block for `tile` tokens."""

    def one(i: int, layer: list[Target]) -> int:
        inside: tuple[str, ...] = ()
        if tile > 0 and spec is not None:  # natively every linear layer is tiled (model.tiled_layer)
            inside = spec.visit(lambda _: ("",), lambda g: block_prefixes(g, i))
        blk = sum(r + t.out_features for t in layer if t.rel.startswith(inside))
        return tokens * sum(r + t.out_features for t in layer) - (tokens - min(tile, tokens)) * blk

    return max((one(i, layer) for i, layer in enumerate(targets)), default=0) * item


def adapter_kept_bytes(targets: list[list[Target]], r: int, dropout: float, tokens: int, item: int) -> int:
    """What the adapters add to a kept layer's graph for one micro-batch, per token and adapted
    linear: A's output (r; B's input), and with dropout its dropped input and the mask (2 x in
    features). The rest (B's output, scaled and added) is not saved for the backward."""
    drop = 2 if dropout else 0
    widest = max((sum(r + drop * t.in_features for t in layer) for layer in targets), default=0)
    return tokens * widest * item


def lora_memory_plan(
    spec: ArchSpec,
    targets: list[list[Target]],
    r: int,
    dtype: str = "bfloat16",
    grad_dtype: str = "auto",
    batch: int = 1,
    micro_batch: int = 1,
    seq: int = 2048,
    prefetch: int = 2,
    loss_chunk: int = 2048,
    quant: str = "",
    world: int = 1,
    per_node: int = 1,
    dropout: float = 0.0,
    stream: str = "",
) -> MemoryPlan:
    """stream: the frozen base's streaming dtype ("": dtype; a bf16 store computing in fp32 across
    a link: bfloat16, upcast on the device, state.widen)."""
    item = ITEM[dtype]
    stream = stream or dtype
    gitem = ITEM[dtype if grad_dtype == "auto" else grad_dtype]
    lays = {lay.name: lay for lay in layouts(spec)}
    base = base_bytes(spec, stream, quant)
    n_adapt = adapter_params(targets, r)
    per_layer = max(
        (sum(r * (t.in_features + t.out_features) for t in layer) for layer in targets), default=0
    )
    acts = rank_batch(batch, world) * seq * spec.boundary_width * item
    p = MemoryPlan(
        sum(lay.params for lay in lays.values()), trainable=n_adapt, world=world, per_node=per_node
    )
    # a rank's piece of each unit's streaming bytes (a packed unit is split as a flat byte buffer)
    p.host[f"base weights (frozen{', NF4 layers' if quant else ''})"] = sum(
        piece(v, world) for v in base.values()
    )
    p.host["adapters (streaming copy)"] = n_adapt * item
    if dtype == "bfloat16":
        p.host["adapter master remainder (int16)"] = n_adapt * 2
    p.host["adapter AdamW moments (fp32)"] = n_adapt * 8
    p.host[f"adapter gradients ({'bf16' if gitem == 2 else 'fp32'})"] = n_adapt * gitem
    p.host["saved activations"] = spec.n_layers * acts
    p.host["staging"] = acts
    layer_max = max(v for k, v in base.items() if k.startswith("layer."))
    head = base["head"] + (base["embed"] if spec.tie_embeddings else 0)
    p.device["weight buffers"] = prefetch * layer_max + head
    dense_layer = max(lays[k].numel for k in base if k.startswith("layer.")) * item
    if quant:
        p.device["dequantized layer"] = dense_layer
    upcast = dense_layer if ITEM[stream] < item and not quant else 0  # state.widen: one layer's
    if ITEM[stream] < item:
        head_numel = lays["head"].numel + (lays["embed"].numel if spec.tie_embeddings else 0)
        p.device["upcast buffers (layer, head)"] = upcast + head_numel * item
    p.device["adapters in flight"] = prefetch * per_layer * item
    narrow = gitem if gitem != 4 else 0  # the narrow copies that cross the link
    # sharded: the all-reduce's own narrow copies instead of these (below)
    p.device["gradient accumulators"] = 2 * per_layer * (4 + (narrow if world == 1 else 0))
    p.device["saved inputs in flight"] = prefetch * acts
    p.device["activations"] = 2 * acts
    tok = micro_batch * seq
    work = layer_work_bytes(spec, tok, micro_batch, seq, item)
    p.device["layer working set"] = work + adapter_work_bytes(targets, r, tok, item)
    p.device["loss head working set"] = head_work_bytes(spec, tok, loss_chunk, item)
    # attention's fp32 dQ and grouped dK/dV in every backward, the adapters' gradients at once
    p.device["backward transients"] = backward_transient_bytes(spec, tok, per_layer, item)
    if world > 1:  # engine/sharded.py: the frozen embedding gathered on the device (the host holds a
        # slice); the adapters' gradients all-reduced whole into four fp32 outputs (and narrow copies)
        gathered = base_bytes(spec, stream, quant, world)  # the device's whole units, padded
        layer_pad = max(v for k, v in gathered.items() if k.startswith("layer.")) - layer_max
        ends = sum(gathered[k] - base[k] for k in ("head", "embed"))  # each its own buffer
        p.device["padding of gathered units"] = prefetch * layer_pad + ends
        if not spec.tie_embeddings:
            p.device["embedding table (gathered)"] = base["embed"]
        p.device["adapter gradient all-reduce outputs"] = 4 * per_layer * (4 + narrow)
    # one kept layer: its own weight buffer (packed for NF4, padded as a gathered unit), its adapters,
    # its own dequantized copy (NF4: the shared scratch buffer is overwritten by the next layer), the
    # graphs of this rank's micro-batches
    slot = max(v for k, v in base_bytes(spec, stream, quant, world).items() if k.startswith("layer."))
    dense = p.device.get("dequantized layer", 0)
    mbs = max(1, rank_batch(batch, world) // micro_batch)
    vectors = layer_vectors(lays.values())
    graph = kept_graph_bytes(spec, tok, micro_batch, seq, item, vectors)
    graph += adapter_kept_bytes(targets, r, dropout, tok, item)
    p.layers, p.saved_layer, p.kept_mbs, p.kept_vectors = spec.n_layers, acts, mbs, vectors
    p.kept_layer = (slot + per_layer * item + dense + upcast, mbs * graph)
    return with_loop(p, spec, acts, per_layer * 4)
