"""What a layer's backward holds briefly beside the working set (planning.memory's row "backward
transients"), on any device:

    weight gradients   torch.autograd.grad returns all of a layer's weight gradients at once, in
                       the compute dtype, before engine.passes adds them into the fp32 sums (one
                       layer: 1.7 GB in bf16 at 70B)
    dq accumulator     flash attention's backward accumulates dQ in fp32 (tokens x q_dim x 4 B)
    grouped K/V        with grouped-query attention the kernel's dK and dV are per query head
                       before they are summed per group (tokens x 2 q_dim, compute dtype)

and the margin `keep_activations: auto` leaves on a GPU beyond the fit check's reserve: kept
graphs are the plan's estimate, and the caching allocator fragments; filling the card to the
reserve would make the first step an out-of-memory.
"""

from __future__ import annotations

from ..arch.spec import ArchSpec

KEEP_MARGIN = 0.1  # the share of a GPU's free memory `auto` does not fill with kept layers


def backward_transient_bytes(spec: ArchSpec, tokens: int, layer_numel: int, item: int, tile: int = 0) -> int:
    """One micro-batch of `tokens` tokens through a layer of `layer_numel` parameters' backward;
    tile: engine.seq_tile's tokens per tile (0: untiled), the native layer's attention then runs
    per query tile, its fp32 dQ accumulator one tile's (transformers' layers attend whole)."""
    q = spec.q_dim
    grouped = 2 * q * item if spec.n_heads != spec.n_kv_heads else 0
    queries = spec.pick(tile if 0 < tile < tokens else tokens, tokens)
    return layer_numel * item + tokens * grouped + queries * 4 * q
