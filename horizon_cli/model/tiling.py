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
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

Block = Callable[[torch.Tensor], tuple[torch.Tensor, tuple[torch.Tensor, ...]]]


def tiles(n: int, tile: int) -> list[tuple[int, int]]:
    """[start, end) of each tile of `tile` tokens over n (the last one shorter when it does not divide)."""
    return [(s, min(n, s + tile)) for s in range(0, n, tile)]


def run_tiled(block: Block, x: torch.Tensor, tile: int, lora: Any = None) -> tuple[torch.Tensor, tuple]:
    """block: (1, t, H) -> ((1, t, H), caught: tensors with t rows on dim 0), for any t.
    x (..., H) -> (block's output shaped as x, caught concatenated over the tiles). tile <= 0 or
    at least the tokens: the block once on x as it is (untiled, bit for bit as without tiles)."""
    H = x.shape[-1]
    n = x.numel() // H
    if tile <= 0 or n <= tile:
        return block(x)
    flat = x.reshape(1, n, H)
    base = lora.mb if lora is not None else None
    ys: list[torch.Tensor] = []
    caught: list[tuple[torch.Tensor, ...]] = []
    grad = torch.is_grad_enabled()
    # split, not sliced: autograd assembles the input's gradient once from the tiles' (a slice's
    # backward writes a whole-length tensor per tile)
    for (s, _), part in zip(tiles(n, tile), flat.split(tile, dim=1), strict=True):

        def one(xt: torch.Tensor, s: int = s):
            if lora is not None:  # a dropout mask of this tile's own (forward and recompute alike)
                lora.mb = (base, "tile", s)
            try:
                return block(xt)
            finally:
                if lora is not None:
                    lora.mb = base

        y, c = checkpoint(one, part, use_reentrant=False) if grad else one(part)
        ys.append(y)
        caught.append(c)
    y = torch.cat(ys, dim=1).view(x.shape)
    return y, tuple(torch.cat(parts, dim=0) for parts in zip(*caught, strict=True))


def tiled_native(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int, lora: Any,
    leaves: list[torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """The native layer's token-local block fn (h -> h + mlp(norm(h))) over x (b, T, H), tiled.
    leaves given (the backward's recompute: the block's weights and adapters): the block is not
    run now but in the backward, tile by tile (_Deferred)."""
    if leaves is not None and torch.is_grad_enabled() and 0 < tile < x.numel() // x.shape[-1]:
        return _Deferred.apply(x, (fn, tile, lora), *leaves)
    return run_tiled(lambda h: (fn(h), ()), x, tile, lora)[0]


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
    def forward(ctx, x: torch.Tensor, job: tuple, *leaves: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.job, ctx.leaves = job, leaves  # the tensors the block computes with, as it holds them
        return torch.empty_like(x)  # never read (class doc)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        fn, tile, lora = ctx.job
        leaves: tuple[torch.Tensor, ...] = ctx.leaves
        H = x.shape[-1]
        n = x.numel() // H
        flat, dflat = x.detach().reshape(1, n, H), dy.reshape(1, n, H)
        need = [i for i, t in enumerate(leaves) if t.requires_grad]
        dx = torch.empty_like(flat)
        acc: list[torch.Tensor | None] = [None] * len(leaves)
        base = lora.mb if lora is not None else None
        for s, e in tiles(n, tile):
            xt = flat[:, s:e].detach().requires_grad_(True)
            if lora is not None:
                lora.mb = (base, "tile", s)  # the mask the forward sweep's tile drew
            try:
                with torch.enable_grad():
                    yt = fn(xt)
                    grads = torch.autograd.grad(
                        yt, [xt, *(leaves[i] for i in need)], dflat[:, s:e], allow_unused=True
                    )
            finally:
                if lora is not None:
                    lora.mb = base
            dx[:, s:e] = grads[0]
            for i, g in zip(need, grads[1:], strict=True):
                if g is not None:
                    prev = acc[i]
                    acc[i] = g if prev is None else prev + g
        return (dx.view(x.shape), None, *acc)


def set_tile(tmpl: Any, tile: int) -> None:
    """Tile the template's layers by `tile` tokens (0: untiled). The native layer reads it per
    call; transformers' layers get their token-local blocks (arch.tiling) wrapped, once."""
    tmpl.seq_tile = tile
    if tile and hasattr(tmpl, "g") and not getattr(tmpl, "_tiled", None):
        from ..arch.tiling import blocks

        found = blocks(tmpl.g)
        tmpl._tiled = {}
        for i, layer in enumerate(tmpl.layers):
            for path in found.get(tmpl.g.layer_kinds[i], ()):
                _wrap(tmpl, i, layer.get_submodule(path))
                tmpl._tiled.setdefault(i, []).append(path)


def _wrap(tmpl: Any, i: int, mod: torch.nn.Module) -> None:
    """Replace the block's forward (on the meta template module) by its tiled run: each tile with
    the tensors the module is bound to at call time (the streamed weights functional_call put in
    place; the backward's recompute runs after that call has returned), the layer's LoRA adapters
    and its router outputs caught per tile (GenericTemplate's hooks write `_caught[i]`)."""
    from torch.nn.utils.stateless import _reparametrize_module

    orig = mod.forward

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        given = [*args, *kwargs.values()]
        tile = tmpl.seq_tile
        if len(given) != 1 or tile <= 0 or not isinstance(given[0], torch.Tensor):
            return orig(*args, **kwargs)
        hidden_states = given[0]
        bound = {**dict(mod.named_parameters()), **dict(mod.named_buffers())}
        lora, caught = tmpl._lora, tmpl._caught
        # train or eval mode as at this call (engine.dropout's scope): a tile's checkpointed
        # recompute runs in the backward, after the scope has put the modules back in eval mode
        modes = [(m, m.training) for m in mod.modules()]

        def block(xt: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            prev, outer = caught.pop(i, None), tmpl._lora
            was = [m.training for m, _ in modes]
            tmpl._lora = lora
            for m, on in modes:
                m.training = on
            try:
                with _reparametrize_module(mod, bound, strict=False):
                    y = orig(xt)
                got = caught.pop(i, ())
            finally:
                for (m, _), on in zip(modes, was, strict=True):
                    m.training = on
                tmpl._lora = outer
                if prev is not None:
                    caught[i] = prev
            if not isinstance(y, torch.Tensor):
                raise RuntimeError(
                    f"layer {i}: its token-local block returns a {type(y).__name__}, not a tensor"
                )
            return y, tuple(got)

        y, got = run_tiled(block, hidden_states, tile, lora)
        if got:
            caught[i] = got
        return y

    mod.forward = forward  # type: ignore[method-assign]
