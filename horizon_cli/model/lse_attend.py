"""A causal query tile's attention without a mask (CPU, model.tiled_layer): two unmasked pieces.

The queries of positions [s, e) see keys [lo, e), lo < s, plain causal (no packed documents, no
window). Keys [lo, s) are all visible and the diagonal block [s, e) is square (causal with
SDPA's top-left alignment), so the tile runs as two calls of the CPU flash kernel, neither
masked, joined by their log-sum-exp:

  lse = logaddexp(l1, l2),  out = exp(l1 - lse) o1 + exp(l2 - lse) o2   (in float64)

The masked call it replaces computes the upper half of the diagonal block and reads a mask. The
backward (as ring attention's) runs the flash backward of each piece with the *joined* out and
lse: its D = rowsum(dout * out) and P = exp(S - lse) are then the whole row's, so each piece's
dq, dk, dv is its exact share; dq is summed over the pieces. Grouped-query K/V go to the kernel
as they are (it shares them across query heads).
"""

from __future__ import annotations

import torch

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def causal_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (b, heads, t, hd) for queries [s, s + t), k/v (b, kv_heads, s - lo + t, hd) for keys
    [lo, s + t), lo < s -> (b, heads, t, hd): causal attention of the tile's queries."""
    return _Joined.apply(q, k, v, k.shape[2] - q.shape[2], scale)


def _pieces(k: torch.Tensor, v: torch.Tensor, n: int):
    """(k, v, is_causal) of the two pieces: the n keys before the tile, the diagonal block."""
    return ((k[:, :, :n], v[:, :, :n], False), (k[:, :, n:], v[:, :, n:], True))


class _Joined(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, n: int, scale: float):  # type: ignore[override]
        (k1, v1, c1), (k2, v2, c2) = _pieces(k, v, n)
        o1, l1 = _fwd(q, k1, v1, 0.0, c1, scale=scale)
        o2, l2 = _fwd(q, k2, v2, 0.0, c2, scale=scale)
        ldt = l1.dtype  # joined in float64 (t x heads x hd, cheap): its rounding is the kernel's only
        l1, l2, o1, o2 = l1.double(), l2.double(), o1.double(), o2.double()
        lse = torch.logaddexp(l1, l2)
        out = (torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2).to(q.dtype)
        lse = lse.to(ldt)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.n, ctx.scale = n, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        at = (slice(None, ctx.n), slice(ctx.n, None))
        for (ki, vi, causal), sl in zip(_pieces(k, v, ctx.n), at, strict=True):
            gq, gk, gv = _bwd(dout, q, ki, vi, out, lse, 0.0, causal, scale=ctx.scale)
            dq += gq
            dk[:, :, sl], dv[:, :, sl] = gk, gv
        return dq, dk, dv, None, None
