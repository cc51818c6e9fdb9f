"""The native decoder layer run in sequence tiles (engine.seq_tile), attention included.

Every part of the layer but the attention kernel is token-local: the pre-attention norm, the
Q/K/V projections (biases, Qwen3's q/k norms, RoPE at the tile's positions), the output
projection and residual, and the MLP block. So the layer runs row by row, and in a row

  kv pass    per tile of `tile` positions: norm, K/V projections, k norm, RoPE, written into the
             row's K and V (1, kv_heads, T, hd): with the layer's input and output the only
             full-length tensors
  out pass   per query tile [s, e): norm, Q projection, q norm, RoPE; SDPA of the tile's queries
             over the keys it can see ([lo, e): causal, and within the window), masked by the
             tile's rows of the mask (attend.rows_mask: (1, 1, t, e - lo), never (T, T)); output
             projection, residual, MLP block -> the tile's output rows

The backward (_Layer; the recompute's forward returns an output it never computes when its
values are not read, `deferred`, as model.tiling's _Deferred does for the MLP block) redoes the
kv pass without autograd, then per tile the out pass under autograd seeded with the tile's slice
of the output gradient (giving the tile's input gradient, the weights' and the tile's share of
dK/dV, summed into full-length dK, dV), then per tile the kv pass under autograd seeded with its
slice of dK/dV. Weight gradients are added over the tiles. Per token the arithmetic is the
untiled layer's (the order weight gradients of different tiles are summed in differs: fp32
rounding). The attention kernel runs as often as untiled (forward sweep, recompute, backward);
the K/V projections once more (the kv pass of the backward).

LoRA dropout draws a mask per tile (its first token, counted over the rows, names it: the tile's
call, model.call.LayerCall.in_tile, whose adapters the stages are given), the same in the forward
and the backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from . import tiling
from .call import LayerCall, Lora

Adapters = Lora | None


class Stages(NamedTuple):
    """The layer's token-local passes, for one row r and positions [s, e) with the tile's adapters:
    kv(r, s, e, x (1, t, H), lora) -> k, v (1, kv_heads, t, hd); keys(s, e) -> lo, the first key
    the tile's queries can see; out(r, s, e, x (1, t, H), k, v (1, kv_heads, e - lo, hd), lora) ->
    (1, t, H)."""

    kv: Callable[[int, int, int, torch.Tensor, Adapters], tuple[torch.Tensor, torch.Tensor]]
    keys: Callable[[int, int], int]
    out: Callable[[int, int, int, torch.Tensor, torch.Tensor, torch.Tensor, Adapters], torch.Tensor]
    kv_heads: int
    head_dim: int


def run_layer(st: Stages, x: torch.Tensor, call: LayerCall, leaves: list[torch.Tensor]) -> torch.Tensor:
    """x (b, T, H) -> the layer's output (b, T, H) in tiles of call.tile tokens. leaves: the tensors
    it computes with (weights, adapters); under autograd the backward differentiates them (_Layer)."""
    if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in leaves)):
        return _Layer.apply(x, (st, call), *leaves)
    return _forward(st, x, call)


def _tile(call: LayerCall, r: int, T: int, s: int) -> Adapters:
    """LoRA's adapters for the tile of row r whose first position is s (named over the rows)."""
    return call.in_tile(r * T + s).adapters


def _kv(st: Stages, x: torch.Tensor, r: int, call: LayerCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The kv pass of row r without autograd: K, V (1, kv_heads, T, hd)."""
    T = x.shape[1]
    K = x.new_empty(1, st.kv_heads, T, st.head_dim)
    V = torch.empty_like(K)
    with torch.no_grad():
        for s, e in tiling.tiles(T, call.tile):
            K[:, :, s:e], V[:, :, s:e] = st.kv(r, s, e, x[r : r + 1, s:e], _tile(call, r, T, s))
    return K, V


def _forward(st: Stages, x: torch.Tensor, call: LayerCall) -> torch.Tensor:
    b, T, _ = x.shape
    y = torch.empty_like(x)
    with torch.no_grad():
        for r in range(b):
            K, V = _kv(st, x, r, call)
            for s, e in tiling.tiles(T, call.tile):
                lo, lora = st.keys(s, e), _tile(call, r, T, s)
                y[r : r + 1, s:e] = st.out(r, s, e, x[r : r + 1, s:e], K[:, :, lo:e], V[:, :, lo:e], lora)
            del K, V
    return y


class _Layer(torch.autograd.Function):
    """The tiled layer under autograd: the forward without a graph (deferred: not at all, its
    values are never read), the backward tile by tile (module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, job: tuple[Stages, LayerCall], *leaves: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        st, call = job
        ctx.save_for_backward(x)
        ctx.job, ctx.leaves = job, leaves
        return torch.empty_like(x) if call.deferred else _forward(st, x, call)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        st, call = ctx.job
        tile = call.tile
        leaves: tuple[torch.Tensor, ...] = ctx.leaves
        need = [i for i, t in enumerate(leaves) if t.requires_grad]
        acc: list[torch.Tensor | None] = [None] * len(leaves)

        def add(grads) -> None:
            for i, g in zip(need, grads, strict=True):
                if g is not None:
                    prev = acc[i]
                    acc[i] = g if prev is None else prev.add_(g)  # in place: one copy of each

        x = x.detach()
        b, T, _ = x.shape
        dx = torch.empty_like(x)
        for r in range(b):
            K, V = _kv(st, x, r, call)
            dK, dV = torch.zeros_like(K), torch.zeros_like(V)
            for s, e in tiling.tiles(T, tile):  # out pass: dx, the weights', dK/dV
                lo = st.keys(s, e)
                xt = x[r : r + 1, s:e].detach().requires_grad_(True)
                kt = K[:, :, lo:e].detach().requires_grad_(True)
                vt = V[:, :, lo:e].detach().requires_grad_(True)
                with torch.enable_grad():
                    yt = st.out(r, s, e, xt, kt, vt, _tile(call, r, T, s))
                    g = torch.autograd.grad(
                        yt, [xt, kt, vt, *(leaves[i] for i in need)], dy[r : r + 1, s:e], allow_unused=True
                    )
                dx[r : r + 1, s:e] = g[0]
                if g[1] is not None:
                    dK[:, :, lo:e] += g[1]
                if g[2] is not None:
                    dV[:, :, lo:e] += g[2]
                add(g[3:])
            del K, V
            for s, e in tiling.tiles(T, tile):  # kv pass: dx, the K/V weights'
                xt = x[r : r + 1, s:e].detach().requires_grad_(True)
                with torch.enable_grad():
                    k, v = st.kv(r, s, e, xt, _tile(call, r, T, s))
                    g = torch.autograd.grad(
                        [k, v],
                        [xt, *(leaves[i] for i in need)],
                        [dK[:, :, s:e], dV[:, :, s:e]],
                        allow_unused=True,
                    )
                dx[r : r + 1, s:e] += g[0]
                add(g[1:])
            del dK, dV
        return (dx, None, *acc)
