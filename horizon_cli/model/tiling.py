"""Sequence tiles (`engine.seq_tile`): a layer's token-local block run tile by tile.

A token-local block (the native layer's MLP norm + SwiGLU + residual; a transformers layer's MLP
or MoE module, found by arch.tiling) computes each token from that token alone, so it can run
on any slice of the tokens. With a tile of N tokens the layer's rows are flattened to
(1, b·T, H) and the block runs on N of them at a time:

  no autograd   (the forward sweep, evaluation) each tile's intermediates are freed before the
                next tile runs; only the block's output (b·T, H) is whole
  autograd      (the backward's recompute, a kept layer's forward) each tile runs under
                non-reentrant activation checkpointing: the graph holds the tile's input (a view
                of the block's input, which the layer holds anyway) and its output, nothing of
                what the block computes inside; the backward recomputes one tile at a time
                (autograd visits the tiles one after another, last first), seeds it with its
                slice of the output gradient and adds its weight gradients to the layer's

So the block's intermediates (an MLP's gate, up and their product: 3-4 × the intermediate size
per token, the largest term of a layer's working set) exist for one tile at a time, and the
arithmetic per token is the untiled block's (the same ops on the same rows; only the order in
which weight gradients of different tiles are added differs: fp32 rounding).

Outputs of modules inside the block that the template catches with hooks (MoE router logits,
(tokens, E)) are caught per tile and concatenated along the tokens, under autograd with their
graph, so the load-balancing loss differentiates through them as untiled. LoRA dropout draws
its masks per tile (the seed names the tile's first token), the same in forward and recompute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from .call import LayerCall, Lora

# a token-local block over one tile: (1, t, H) and the tile's call -> ((1, t, H), caught: tensors
# with t rows on dim 0)
Block = Callable[[torch.Tensor, LayerCall], tuple[torch.Tensor, tuple[torch.Tensor, ...]]]
Fn = Callable[[torch.Tensor, Lora | None], torch.Tensor]  # the native block: h, its adapters -> h


def tiles(n: int, tile: int) -> list[tuple[int, int]]:
    """[start, end) of each tile of `tile` tokens over n (the last one shorter when it does not divide)."""
    return [(s, min(n, s + tile)) for s in range(0, n, tile)]


def run_tiled(
    block: Block, x: torch.Tensor, call: LayerCall
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """x (..., H) -> (block's output shaped as x, caught concatenated over the tiles), in tiles of
    call.tile tokens, each tile's block given its own call (`in_tile`: its dropout masks). A tile
    <= 0 or at least the tokens: the block once on x as it is (untiled, bit for bit as without
    tiles)."""
    H = x.shape[-1]
    n = x.numel() // H
    if call.tile <= 0 or n <= call.tile:
        return block(x, call)
    flat = x.reshape(1, n, H)
    ys: list[torch.Tensor] = []
    caught: list[tuple[torch.Tensor, ...]] = []
    grad = torch.is_grad_enabled()
    # split, not sliced: autograd assembles the input's gradient once from the tiles' (a slice's
    # backward writes a whole-length tensor per tile)
    for (s, _), part in zip(tiles(n, call.tile), flat.split(call.tile, dim=1), strict=True):
        one = call.in_tile(s)  # a dropout mask of this tile's own (forward and recompute alike)
        y, c = checkpoint(block, part, one, use_reentrant=False) if grad else block(part, one)
        ys.append(y)
        caught.append(c)
    y = torch.cat(ys, dim=1).view(x.shape)
    return y, tuple(torch.cat(parts, dim=0) for parts in zip(*caught, strict=True))


def tiled_native(
    fn: Fn, x: torch.Tensor, call: LayerCall, leaves: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """The native layer's token-local block fn (h -> h + mlp(norm(h))) over x (b, T, H), tiled.
    leaves given (the backward's recompute: the block's weights and adapters): the block is not
    run now but in the backward, tile by tile (_Deferred)."""
    if leaves is not None and torch.is_grad_enabled() and 0 < call.tile < x.numel() // x.shape[-1]:
        return _Deferred.apply(x, (fn, call), *leaves)

    def block(h: torch.Tensor, c: LayerCall) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return fn(h, c.adapters), ()

    return run_tiled(block, x, call)[0]


class _Deferred(torch.autograd.Function):
    """The recompute's block, run only by its backward. The recompute exists for its graph: the
    layer's output values are never read there (autograd.grad is seeded with the gradient coming
    from the layer above; the native block ends the layer, so nothing after it saves them), so
    the forward returns an output of the right shape without computing it, and the backward runs
    each tile under autograd — its forward, then its backward seeded with the tile's slice of the
    output gradient — adding the weights' gradients over the tiles. The block's arithmetic runs
    as often as untiled (forward sweep, recompute's forward, backward); with checkpointing it
    would run once more."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, job: tuple[Fn, LayerCall], *leaves: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.job, ctx.leaves = job, leaves  # the tensors the block computes with, as it holds them
        return torch.empty_like(x)  # never read (class doc)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        fn, call = ctx.job
        leaves: tuple[torch.Tensor, ...] = ctx.leaves
        H = x.shape[-1]
        n = x.numel() // H
        flat, dflat = x.detach().reshape(1, n, H), dy.reshape(1, n, H)
        need = [i for i, t in enumerate(leaves) if t.requires_grad]
        dx = torch.empty_like(flat)
        acc: list[torch.Tensor | None] = [None] * len(leaves)
        for s, e in tiles(n, call.tile):
            xt = flat[:, s:e].detach().requires_grad_(True)
            with torch.enable_grad():  # the mask the forward sweep's tile drew
                yt = fn(xt, call.in_tile(s).adapters)
                grads = torch.autograd.grad(
                    yt, [xt, *(leaves[i] for i in need)], dflat[:, s:e], allow_unused=True
                )
            dx[:, s:e] = grads[0]
            for i, g in zip(need, grads[1:], strict=True):
                if g is not None:
                    prev = acc[i]
                    acc[i] = g if prev is None else prev + g
        return (dx.view(x.shape), None, *acc)
