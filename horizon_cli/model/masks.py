"""Per micro-batch attention context: RoPE tables and the mask each window size needs.

No mask when plain causal attention is exact (no packing, no window shorter than T): SDPA's
fused causal path. Otherwise a flex block mask on CUDA and a dense bool mask on the CPU
(model/attend.py says why) — or, when the native layer runs the micro-batch in sequence tiles,
the mask's rule alone (attend.RowMask), whose rows each query tile builds for itself: no (T, T)
tensor exists. On CUDA too: flex's block mask would keep the layer's attention whole (and its
Q/K/V projections untiled), which the tiled plan does not count.
"""

from __future__ import annotations

import torch

from ..arch import ArchSpec
from ..data.batch import DecodeBatch, MicroBatch
from .attend import Mask, RowMask, block_mask, dense_mask
from .layer import AttnContext, rope_tables


def attn_context(
    mb: MicroBatch,
    spec: ArchSpec,
    inv: torch.Tensor,
    dtype: torch.dtype,
    device,
    fused: bool | None = None,
    rows: bool = False,
) -> AttnContext:
    """fused: block masks for flex_attention (default: on CUDA) rather than dense ones; rows: the
    layers run this micro-batch in sequence tiles (engine.seq_tile), so a mask is a RowMask."""
    device = torch.device(device)
    fused = device.type == "cuda" if fused is None else fused
    pos = mb.position_ids.to(device, non_blocking=True)
    cos, sin = rope_tables(inv, pos, dtype)
    b, T = mb.input_ids.shape
    doc = mb.doc_ids.to(device, non_blocking=True) if mb.doc_ids is not None else None
    masks: dict[int | None, Mask] = {}
    for window in set(spec.windows):
        if doc is None and (window is None or window >= T):
            masks[window] = None
        elif fused and not rows:
            masks[window] = block_mask(doc, window, b, T, device)
        else:
            masks[window] = RowMask(doc, window, b, T) if rows else dense_mask(doc, window, b, T, device)
    return AttnContext(cos, sin, masks)


def cached_context(
    db: DecodeBatch, spec: ArchSpec, inv: torch.Tensor, dtype: torch.dtype, device, cache
) -> AttnContext:
    """A generation sweep's context: RoPE tables of the new tokens' positions, and per window a
    bool (b, 1, T, past + T) mask over the cached positions and the new ones (True = attend):
    causal, not a row's left padding, within the window. A padding query (prefill) sees itself
    only, so no row of the kernel is empty (its output is never read). None where every key is
    visible: no padding, no window cutting in (then SDPA runs unmasked, causal at prefill)."""
    device = torch.device(device)
    cos, sin = rope_tables(inv, db.position_ids.to(device), dtype)
    b, T = db.input_ids.shape
    S = db.past + T
    padded = bool((db.pad > 0).any())
    q = (db.past + torch.arange(T, device=device))[:, None]  # (T, 1) cache index of each query
    j = torch.arange(S, device=device)[None, :]  # (1, S)
    real = db.attention_mask().to(device)[:, None, None, :]  # (b, 1, 1, S)
    masks: dict[int | None, Mask] = {}
    for window in set(spec.windows):
        if not padded and (window is None or window >= S):
            masks[window] = None
            continue
        ok = j <= q
        if window is not None:
            ok = ok & (q - j < window)
        masks[window] = (ok[None, None] & real) | (j == q)[None, None]
    return AttnContext(cos, sin, masks, cache)
