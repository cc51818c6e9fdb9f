"""The memory plan: host and device bytes by category for a model and a run's settings.

Shown by `horizon inspect` and `horizon train --dry-run`, and used to refuse a run that cannot
fit in RAM. The engine reports its device usage with the same formulas on the CPU.

A plan is one rank's. With `world` ranks (sharded data parallelism, parallel/shard.py) a rank's host
holds the largest piece of every unit's flat buffers (streaming copy, master, moments, gradients:
`shard_size(numel, world, SHARD_ALIGN)`) and the saved activations and staging of its share of
the batch (batch / world). Its device holds what a one-rank run's device holds (the whole layer is
all-gathered there; each rank's piece lands in place in the whole-layer buffer) plus what the
sharded step adds (`sharded_device`: the gathered embedding and its dense gradient, the
reduce-scatter outputs, padding).
Node and all-node figures multiply by the ranks per node and the world size.

A streaming copy narrower than the compute dtype (`stream`: lean's bf16 weight computing in fp32,
a bf16 LoRA base computing in fp32 across a link) is held and moved in its own bytes: the host's
copy and the device's weight buffers in `stream`, plus the buffers it is upcast into on the device
(state.widen: one layer's, the head's, and each kept layer's own) in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arch import ArchSpec
from ..arch.tiling import blocks
from ..optim.modes import EXACT, RUNG_MODES, MemoryMode, memory_mode
from ..parallel.shard import SHARD_ALIGN, padded_numel, shard_size
from ..store import layouts
from .host_state import ITEM, compact_rows, frozen_stream, piece, trained_host
from .transients import backward_transient_bytes

__all__ = ["ITEM", "frozen_stream", "piece"]  # re-exported: planning.host_state's, named here too


def gather_pad(numel: int, world: int) -> int:
    """Elements a unit's whole device buffer adds in a sharded run: every rank's piece is padded
    to the largest (runtime.loader.device_numel)."""
    return padded_numel(numel, world) - numel if world > 1 else 0


def rank_batch(batch: int, world: int) -> int:
    """Sequences of the global batch one rank holds (parallel/shard.py check_world: it divides)."""
    return -(-batch // world)


@dataclass
class MemoryPlan:
    """host and device: bytes of one rank (of `world`, `per_node` on each node)."""

    params: int
    trainable: int = 0  # parameters the run updates (LoRA: the adapters)
    host: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)
    world: int = 1
    per_node: int = 1
    # kept layers (engine.keep_activations, planning.keep): K of `layers`, what one kept layer
    # holds on the device (its own weight buffers, its graph for the whole step), and the host's
    # saved inputs of one layer, which a kept layer does not need
    layers: int = 0
    calls: int = 0  # the calls the engine runs (arch.calls: more than `layers` in a loop; 0: as layers)
    loop: str = ""  # a model that runs its layers in a loop: what it does (it keeps no layer)
    kept: int = 0
    kept_layer: tuple[int, int] = (0, 0)
    kept_mbs: int = 1  # the micro-batches whose graphs a kept layer holds (kept_layer's second)
    kept_vectors: int = 0  # 1-D tensors of the largest layer (kept_graph_bytes' `vectors`)
    saved_layer: int = 0
    # sequence tiles (engine.seq_tile, planning.tiling): tokens per tile (0: untiled), and the
    # layer working set untiled, for comparison
    seq_tile: int = 0
    untiled_work: int = 0

    @property
    def kept_bytes(self) -> int:
        return self.kept * sum(self.kept_layer)

    @property
    def nodes(self) -> int:
        return -(-self.world // self.per_node)

    @property
    def node_host_total(self) -> int:
        """Host bytes of one node: its ranks' pieces side by side in its RAM."""
        return self.host_total * self.per_node

    @property
    def node_device_total(self) -> int:
        return self.device_total * self.per_node

    @property
    def all_host_total(self) -> int:
        return self.host_total * self.world

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
        """State bytes of all ranks per parameter (the largest piece times the world size)."""
        return self.state_bytes * self.world / max(1, self.params)


def layer_work_bytes(spec: ArchSpec, tokens: int, rows: int, T: int, item: int, tile: int = 0) -> int:
    """One layer's forward+backward working set for one micro-batch (tokens = rows * T). tile:
    engine.seq_tile, the tokens a tile's intermediates exist for at a time (0: all of them):
    natively every token-local part (model.tiled_layer: native_tiled_bytes), on transformers'
    layers their MLP/MoE block (model.tiling)."""
    return spec.pick(native_work_bytes, generic_work_bytes)(spec, tokens, rows, T, item, tile)


def native_work_bytes(spec: ArchSpec, tokens: int, rows: int, T: int, item: int, tile: int) -> int:
    """layer_work_bytes of the native layer (model/layer.py)."""
    per_tok = 4 * spec.hidden + spec.q_dim + 2 * spec.kv_dim
    if 0 < tile < tokens:
        return native_tiled_bytes(spec, tokens, T, item, min(tile, T), per_tok)
    masked = any(w is not None and w < T for w in spec.windows)
    attn = rows * T * T if masked else 0  # the CPU's dense bool mask (CUDA: a flex block mask, far smaller)
    return 2 * tokens * (per_tok + 3 * spec.intermediate) * item + attn


def native_tiled_bytes(spec: ArchSpec, tokens: int, T: int, item: int, t: int, per_tok: int) -> int:
    """The native layer in tiles of t positions of a row (model.tiled_layer), as its backward
    holds it at its peak (tests/planning/test_seq_tile_plan.py measures it):

      whole      the layer's output and input gradient (tokens x H); one row's K, V, dK, dV and
                 the tile's K/V gradients (6 kv per position); grouped-query K/V repeated per
                 query head with their gradients where the kernel takes no groups (CUDA: 4 q)
      per tile   every intermediate of the untiled layer for t tokens, forward and backward;
                 the tile's rows of the mask, (t, T) bool and the kernel's additive copy; one
                 layer's weight gradients beside their sums over the tiles
    """
    H, q, kv = spec.hidden, spec.q_dim, spec.kv_dim
    grouped = 4 * q if spec.n_heads != spec.n_kv_heads else 0
    whole = (2 * tokens * H + T * (6 * kv + grouped)) * item
    weights = (2 * H * q + 2 * H * kv + 3 * H * spec.intermediate) * item
    return whole + 2 * t * (per_tok + 3 * spec.intermediate) * item + t * T * (1 + item) + weights


def generic_work_bytes(spec: ArchSpec, tokens: int, rows: int, T: int, item: int, tile: int = 0) -> int:
    """The same estimate for a generic layer, read off its tensor table: every projection's output
    per token (a matrix (out, in): out; a routed expert tensor (E, a, b): top-k times the side that
    is not the hidden size), plus the residual stream and norms, held for the backward; attention
    scores where they are materialised (eager attention, or explicit masks: sliding windows). A
    recurrent mixer counts what it was measured to save instead of its projections (arch.workset:
    its chunked scan's states and decay matrices, rows * (fixed + per_token * T) bytes), twice.
    tile: what the kind's token-local blocks (arch.tiling) count is for `tile` tokens only, and
    3 H a token of each stays whole (its tiles' outputs, their concatenation, its input's gradient)."""
    g = spec.generic
    assert g is not None
    moe, H = g.moe, spec.hidden
    found = blocks(g) if tile > 0 else {}
    worst = 0
    for kind in set(g.layer_kinds):
        n, nb = 4 * spec.boundary_width, 0  # the residual stream (several: hyper-connections); the blocks'
        mixer = g.workset.get(kind)
        inside = mixer.module + "." if mixer else None
        tiled = tuple(f"{b}." for b in found.get(kind, ()))
        for e in g.kinds[kind]:
            shape, k = e.shape, 0
            if inside and e.name.startswith(inside):
                continue
            if moe and len(shape) == 3 and shape[0] == moe.n_experts:
                k = moe.top_k * (shape[1] if shape[2] == H else shape[2]) + H  # + gathered inputs
            elif len(shape) == 2:
                k = shape[0]
            if tiled and e.name.startswith(tiled):
                nb += k
            else:
                n += k
        if nb:  # tiled (model.tiling.run_tiled): whole, the tiles' outputs and their concatenation, and
            n += 3 * H * len(tiled)  # the block input's gradient autograd assembles from the tiles' views
        b = 2 * (tokens * n + min(tile, tokens) * nb) * item
        if mixer:
            fixed, per_token = mixer.saved["float32" if item >= 4 else "bfloat16"]
            b += 2 * int(rows * fixed + tokens * per_token)
        worst = max(worst, b)
    masked = g.attn == "eager" or any(w is not None and w < T for w in spec.windows)
    attn = rows * spec.n_heads * T * T * (4 + item) if masked else 0  # fp32 softmax + its input
    return worst + attn


def kept_graph_bytes(
    spec: ArchSpec, tokens: int, rows: int, T: int, item: int, vectors: int, tile: int = 0
) -> int:
    """What a kept layer's autograd graph holds for one micro-batch from its forward to its
    backward (the tensors its forward saved), per token:

      native   model/layer.py's ops: each RMSNorm its input and normalized copies in fp32 and the
               compute dtype (10 B per element; Qwen3's q/k norms too); q and k before RoPE,
               rotated and after, v, the attention output and o_proj's input (5 q + 4 kv); the
               MLP's gate, up, silu(gate) and their product (4 I); the CPU's dense mask where a
               window is shorter than the sequence
      generic  transformers' layers (any op sequence): the working set above, plus for each of
               the layer's `vectors` 1-D tensors (taken as norms over the hidden size) 10 B per
               element
      tile     engine.seq_tile: the generic working set with its blocks tiled; natively the
               layer saves its input only (model.tiled_layer recomputes it in its backward), or
               where only its MLP block is tiled (a flex block mask on CUDA, attention dropout)
               the above less the MLP's 4 I, plus the block's tiles' outputs, their
               concatenation and its input's gradient (3 H), no dense mask (rows per tile)

    tests/engine/test_keep.py checks both against what real layers save (autograd's saved tensors)."""
    return spec.pick(native_graph_bytes, generic_graph_bytes)(spec, tokens, rows, T, item, vectors, tile)


def generic_graph_bytes(
    spec: ArchSpec, tokens: int, rows: int, T: int, item: int, vectors: int, tile: int
) -> int:
    """kept_graph_bytes of transformers' layers: their working set and their 1-D tensors' norms."""
    return layer_work_bytes(spec, tokens, rows, T, item, tile) + tokens * vectors * spec.hidden * 10


def native_graph_bytes(
    spec: ArchSpec, tokens: int, rows: int, T: int, item: int, vectors: int, tile: int
) -> int:
    """kept_graph_bytes of the native layer (model/layer.py's ops, model.tiled_layer's)."""
    H = spec.hidden
    tiled = 0 < tile < tokens
    q, kv = spec.q_dim, spec.kv_dim
    mlp = 3 * H if tiled else 4 * spec.intermediate
    per_tok = 20 * H + (10 * (q + kv) if spec.qk_norm else 0) + (5 * q + 4 * kv + mlp) * item
    masked = not tiled and any(w is not None and w < T for w in spec.windows)
    return tokens * per_tok + (rows * T * T if masked else 0)


def layer_vectors(lays) -> int:
    """The most 1-D tensors (norm scales, biases) in one decoder layer's layout."""
    return max(sum(len(p.shape) == 1 for p in lay.tensors) for lay in lays if lay.name.startswith("layer."))


def head_work_bytes(spec: ArchSpec, tokens: int, chunk: int, item: int) -> int:
    """One logits chunk: compute-dtype logits, their fp32 copy and its gradient; and the chunk's
    LM-head weight gradient (vocab, hidden) in the compute dtype before it is added in fp32."""
    return min(chunk, tokens) * spec.vocab * (item + 8) + spec.vocab * spec.hidden * item


RUNGS = (*RUNG_MODES, "lora", "qlora")  # the ladder, most exact first (each mode without and with release)


def memory_plan(
    spec: ArchSpec,
    dtype: str = "bfloat16",
    grad_dtype: str = "auto",
    batch: int = 1,
    micro_batch: int = 1,
    seq: int = 2048,
    prefetch: int = 2,
    loss_chunk: int = 2048,
    memory: MemoryMode | str = EXACT,
    world: int = 1,
    per_node: int = 1,
    stream: str = "",
) -> MemoryPlan:
    """Full fine-tuning, memory: the mode or its rung (exact, exact+release, lean, lean+release; LoRA
    runs: lora/sizes.py), one rank's. dtype: the compute dtype; stream: the streaming copy's ("":
    the mode's for dtype; lean: bfloat16 whatever it computes in)."""
    mode = memory_mode(memory)
    item = ITEM[dtype]
    stream = stream or mode.stream_dtype(dtype)
    sitem = ITEM[stream]
    lays = {lay.name: lay for lay in layouts(spec)}
    params = sum(lay.params for lay in lays.values())
    layer_max = max(lay.numel for n, lay in lays.items() if n.startswith("layer."))
    head = lays["head"].numel + (lays["embed"].numel if spec.tie_embeddings else 0)
    acts = rank_batch(batch, world) * seq * spec.boundary_width * item  # one layer's boundary activations
    p = MemoryPlan(params, trainable=params, world=world, per_node=per_node)
    gitem = ITEM[mode.grad_dtype(grad_dtype, dtype)]
    p.host = trained_host(lays, stream, gitem, mode, world, compact_rows(spec, lays, batch * seq, world))
    p.host["saved activations"] = spec.n_layers * acts
    p.host["staging"] = 2 * acts
    p.device["weight buffers"] = (prefetch * layer_max + head) * sitem
    upcast = layer_max * item if sitem < item else 0  # state.widen: one layer's, and each kept one's
    if upcast:
        p.device["upcast buffers (layer, head)"] = upcast + head * item
    # narrow wire copies of the layer sums; sharded: the reduce-scatter's own (sharded_device)
    wire = 2 * layer_max * gitem if gitem != 4 and world == 1 else 0
    p.device["gradient accumulators"] = (2 * layer_max + head) * 4 + wire
    p.device["saved inputs in flight"] = prefetch * acts
    p.device["activations"] = 2 * acts
    tok = micro_batch * seq
    p.device["layer working set"] = layer_work_bytes(spec, tok, micro_batch, seq, item)
    p.device["backward transients"] = backward_transient_bytes(spec, tok, layer_max, item)
    p.device["loss head working set"] = head_work_bytes(spec, tok, loss_chunk, item)
    stack = spec.kind.model
    side = stack.side_width if stack is not None else 0
    if side:  # tensors crossing layers (model.side): recorded per micro-batch, with their gradients
        p.device["side inputs"] = 2 * rank_batch(batch, world) * seq * side * item
    if world > 1:
        p.device.update(sharded_device(lays, spec, world, prefetch, sitem, gitem))
    # one kept layer: its own weight buffer (whole, padded as a gathered unit), the graphs of this
    # rank's micro-batches
    mbs = max(1, rank_batch(batch, world) // micro_batch)
    vectors = layer_vectors(lays.values())
    graph = kept_graph_bytes(spec, tok, micro_batch, seq, item, vectors)
    p.layers, p.saved_layer, p.kept_mbs, p.kept_vectors = spec.n_layers, acts, mbs, vectors
    p.kept_layer = ((layer_max + gather_pad(layer_max, world)) * sitem + upcast, mbs * graph)
    return with_loop(p, spec, acts, layer_max * 4)


def with_loop(p: MemoryPlan, spec: ArchSpec, acts: int, grad_sum: int) -> MemoryPlan:
    """A model that runs its layers in a loop (arch.calls): every call's input saved on the host,
    a unit called more than once sums its gradient in an fp32 buffer of its own (`grad_sum` bytes:
    the largest), the outputs a later junction reads held on the device; no layer kept."""
    from ..arch.calls import spec_sequence

    calls = spec_sequence(spec)
    p.calls = len(calls)
    if len(calls) == spec.n_layers and calls == sorted(calls):
        return p
    stack = spec.kind.model
    p.loop = f"{len(calls)} calls for {spec.n_layers} layers"
    p.host["saved activations"] = len(calls) * acts
    repeated = len({i for i in calls if calls.count(i) > 1})
    p.device["gradient sums of layers called more than once"] = repeated * grad_sum
    junctions = stack.junctions if stack is not None and stack.junctions is not None else {}
    held = {d for j, deps in junctions.items() for d in deps if d != j - 1}
    if held:
        p.device["outputs held for the loop's junctions"] = len(held) * acts
    p.kept_layer = (0, 0)
    return p


def sharded_device(
    lays: dict, spec: ArchSpec, world: int, prefetch: int, item: int, gitem: int
) -> dict[str, int]:
    """What a rank's device adds in a sharded run (engine/sharded.py): whole-unit weight buffers and
    fp32 gradient sums padded to world x the largest piece (the layers', the head's, the
    embedding's); the embedding table gathered there (the host holds a slice) and its dense fp32
    gradient; four reduce-scatter outputs (two layers, head, embedding) of the largest piece in
    fp32, and their narrowed copies when gradients cross the link narrowed (these replace the
    one-rank run's wire copies)."""
    layer_max = max(lay.numel for n, lay in lays.items() if n.startswith("layer."))
    embed = lays["embed"].numel
    big = max(shard_size(lay.numel, world, SHARD_ALIGN) for lay in lays.values())
    ends = gather_pad(lays["head"].numel, world) + gather_pad(embed, world)  # each its own buffers
    pads = (prefetch * item + 2 * 4) * gather_pad(layer_max, world) + (item + 4) * ends
    out = {"padding of gathered units": pads}
    if not spec.tie_embeddings:  # tied: the head's buffers already hold the table and its gradient
        out["embedding table (gathered)"] = embed * item
        out["embedding gradient (dense fp32)"] = embed * 4
    out["gradient reduce-scatter outputs"] = 4 * big * (4 + (gitem if gitem != 4 else 0))
    return out
