"""Attention kernels: a fused kernel on every path, no copies of K/V.

                 CPU (exact against transformers)          CUDA
  causal         SDPA, is_causal                           SDPA, is_causal (flash attention)
  packed rows,   SDPA with a dense bool mask (b, 1, T, T)  flex_attention, compiled, with a block
  short windows                                            mask: only blocks holding allowed pairs
                                                           are computed, no (T, T) tensor exists
  query tiles    causal rows (windows too): causal_rows,   SDPA per query tile with its mask rows
  (seq_tile)     SDPA per piece of a tile with a Toeplitz  (1, 1, t, keys), grouped K/V repeated
                 mask view of one (t + keys) vector;       per head (model.layer; not run on a
                 packed rows: SDPA with the tile's mask    GPU yet)
                 rows (1, 1, t, keys). No (T, T) tensor:
                 a RowMask keeps only the rule's inputs

Grouped-query K/V are shared across query heads inside the kernel (`enable_gqa`), never
expanded by copying (but on CUDA under a dense mask, where no fused kernel takes both: expands_kv,
and CUDA's masked query tiles). `enable_gqa` and flex_attention need
torch >= 2.5 (pyproject's floor).
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
# flex_attention compiled for any sequence length: without dynamic shapes each new (T, documents)
# compiled again, and past dynamo's recompile limit flex ran eagerly, materialising the scores
FLEX_DYNAMIC = True
# the variants that remain (grad mode; window or none; documents or none; one key block or more)
FLEX_RECOMPILES = 32
BLOCK = 128  # flex_attention's block size: its kernels evaluate mask_mod on whole blocks


def compile_flex(backend="inductor"):
    """torch.compile(flex_attention) with horizon's options (backend: a test's counter)."""
    return torch.compile(flex_attention, dynamic=FLEX_DYNAMIC, backend=backend)


def _flex():
    """flex_attention compiled (once per process). Eager flex materialises the scores: on CUDA
    it is only ever run compiled; on the CPU (tests) eagerly, forward only."""
    global _compiled
    if _compiled is None:
        import torch._dynamo.config as dynamo

        dynamo.recompile_limit = max(dynamo.recompile_limit, FLEX_RECOMPILES)
        _compiled = compile_flex()
    return _compiled


def expands_kv(device: torch.device, masked: bool, gqa: bool) -> bool:
    """Whether grouped K/V are repeated per query head before SDPA: on CUDA with a mask, where
    no fused kernel takes both a mask and `enable_gqa` (the math kernel would run, holding the
    (b, heads, T, S) fp32 scores); the repeated K/V are (b, heads, S, hd), far smaller."""
    return device.type == "cuda" and masked and gqa


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
    if expands_kv(q.device, mask is not None, gqa):
        n = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1), False
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


KEY_BLOCK = 512  # the CPU flash kernel's key block (kv_split_size in torch's FlashAttentionKernel)


def causal_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: int, window: int | None, scale: float
) -> torch.Tensor:
    """Causal attention (within `window` positions) of queries at positions [s, e) over the keys
    [e - S, e) they can see, on the CPU: q (1, heads, t, hd), k/v (1, kv_heads, S, hd) ->
    (1, heads, t, hd), the rows [s, e) of attend(...) over the whole sequence.

    The tile runs in pieces that end on multiples of KEY_BLOCK, each over the keys its queries can
    see: the key blocks and the work per row are the untiled kernel's (it skips the blocks past
    the diagonal; a whole tile's (t, S) would compute them masked). A piece's mask depends only on
    key - query, so with the piece's queries reversed it is a view of one (t + keys) vector
    (strides 1, 1): the kernel reads no (t, keys) mask from memory, and the rows it computes are
    the untiled kernel's (the order of a row's keys is kept; the order of the rows is free)."""
    t, S = q.shape[2], k.shape[2]
    e = s + t
    lo, outs = e - S, []
    gqa = q.shape[1] != k.shape[1]
    a = s
    while a < e:
        b = min(e, (a // KEY_BLOCK + 1) * KEY_BLOCK)
        first = 0 if window is None else max(0, a - window + 1)  # the first key [a, b) can see
        qa, ka, va = q[:, :, a - s : b - s], k[:, :, first - lo : b - lo], v[:, :, first - lo : b - lo]
        if first == a and (window is None or window >= b - a):  # a causal square: the kernel's own
            o = F.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            m = _toeplitz(b - a, b - first, window, q.dtype, q.device)
            o = F.scaled_dot_product_attention(qa.flip(2), ka, va, attn_mask=m, scale=scale, enable_gqa=gqa)
            o = o.flip(2)
        outs.append(o)
        a = b
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


def _toeplitz(t: int, n: int, window: int | None, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The additive mask (1, 1, t, n) of t reversed queries, the last at the last of n keys: row
    i' (query t - 1 - i') sees key j iff x = i' + j <= n - 1 (causal) and x >= n - window, so it
    is a view of one vector indexed by x."""
    line = torch.zeros(t + n - 1, dtype=dtype, device=device)
    line[n:] = float("-inf")
    if window is not None and n > window:
        line[: n - window] = float("-inf")
    return line.as_strided((1, 1, t, n), (0, 0, 1, 1))


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
    """The flex block mask of `allowed` for a (b, T) micro-batch (shared by every head). The
    kernels evaluate mask_mod on whole blocks, past T when T is not a multiple of BLOCK: the
    documents are padded past T to whole blocks (with -1, no document). On CUDA the mask is built by a
    compiled kernel, block by block, not from an eager (b, T, T) evaluation."""
    if doc is not None:  # always longer than T: a length equal to T would be another compile's guard
        doc = F.pad(doc, (0, BLOCK - T % BLOCK), value=-1)
    compiled = torch.device(device).type == "cuda"
    rows = b if doc is not None else None
    return create_block_mask(allowed(doc, window), rows, None, T, T, device=device, _compile=compiled)


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
