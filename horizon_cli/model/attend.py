"""Attention kernels: a fused kernel on every path, no copies of K/V.

                 CPU (exact against transformers)          CUDA
  causal         SDPA, is_causal                           SDPA, is_causal (flash attention)
  packed rows,   SDPA with a dense bool mask (b, 1, T, T)  flex_attention, compiled, with a block
  short windows                                            mask: only blocks holding allowed pairs
                                                           are computed, no (T, T) tensor exists
  query tiles    SDPA per query tile with its mask rows    the same (model.tiled_layer; a flex
  (seq_tile)     (1, 1, t, keys): no (T, T) tensor, a      block mask keeps the whole-sequence
                 RowMask keeps only the rule's inputs      kernel)

Grouped-query K/V are shared across query heads inside the kernel (`enable_gqa`), never
expanded by copying. `enable_gqa` and flex_attention need torch >= 2.5 (pyproject's floor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


@dataclass(frozen=True)
class RowMask:
    """dense_mask's rule kept as its inputs (engine.seq_tile): a tiled layer builds the rows of
    one query tile at a time (rows_mask), an untiled call the whole mask (attend)."""

    doc: torch.Tensor | None  # (b, T) packed documents, or None
    window: int | None
    b: int
    T: int


Mask = torch.Tensor | BlockMask | RowMask | None  # None: plain causal attention is exact

_compiled = None


def _flex():
    """flex_attention compiled (once per process). Eager flex materialises the scores: on CUDA
    it is only ever run compiled; on the CPU (tests) eagerly, forward only."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention)
    return _compiled


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float, dropout: float = 0.0
) -> torch.Tensor:
    """q (b, heads, T, hd), k/v (b, kv_heads, S, hd) -> (b, heads, T, hd). S > T: q are the last T
    positions of a cached sequence (generation); mask None then means every key is visible
    (SDPA's is_causal aligns top-left, which is causal only for S == T). dropout: on the attention
    probabilities, as transformers' SDPA attention in train mode (flex has none: a template that
    drops builds dense masks, model.masks)."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, RowMask):  # an untiled call under tiles (dropout, one tile): the whole mask
        mask = dense_mask(mask.doc, mask.window, mask.b, mask.T, q.device)
    if isinstance(mask, BlockMask):
        assert not dropout, "flex_attention has no dropout"
        fn = _flex() if q.is_cuda else flex_attention
        return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None and q.shape[-2] == k.shape[-2],
        dropout_p=dropout,
        scale=scale,
        enable_gqa=gqa,
    )


def allowed(doc: torch.Tensor | None, window: int | None):
    """The mask rule as a flex mask_mod (b, h, q, kv) -> bool: causal, within `window` positions
    (transformers: kv > q - window), and inside one's own packed document (doc (b, T))."""

    def mod(b, h, q, kv):
        ok = kv <= q
        if window is not None:
            ok = ok & (q - kv < window)
        if doc is not None:
            ok = ok & (doc[b, q] == doc[b, kv])
        return ok

    return mod


def block_mask(doc: torch.Tensor | None, window: int | None, b: int, T: int, device) -> BlockMask:
    """The flex block mask of `allowed` for a (b, T) micro-batch (shared by every head)."""
    return create_block_mask(allowed(doc, window), b if doc is not None else None, None, T, T, device=device)


def dense_mask(doc: torch.Tensor | None, window: int | None, b: int, T: int, device) -> torch.Tensor:
    """The same rule as a bool (b, 1, T, T) tensor, True = attend."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    m = j <= i  # (T, T) causal
    if window is not None:
        m = m & (i - j < window)
    m = m[None, None]  # (1, 1, T, T)
    if doc is not None:  # packed rows: attend only inside one's own document
        m = m & (doc[:, None, :, None] == doc[:, None, None, :])
    return m.expand(b, 1, T, T)


def rows_mask(
    doc: torch.Tensor | None, window: int | None, r: int, s: int, e: int, lo: int, device
) -> torch.Tensor:
    """Rows [s, e) of row r's dense_mask over keys [lo, e) (the rest are never allowed: causal,
    or out of the window): a bool (1, 1, e - s, e - lo), True = attend."""
    i = torch.arange(s, e, device=device)[:, None]
    j = torch.arange(lo, e, device=device)[None, :]
    m = j <= i
    if window is not None:
        m = m & (i - j < window)
    if doc is not None:
        m = m & (doc[r, s:e, None] == doc[r, None, lo:e])
    return m[None, None]
