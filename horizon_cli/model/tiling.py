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
    for s, e in tiles(n, tile):

        def one(xt: torch.Tensor, s: int = s):
            if lora is not None:  # a dropout mask of this tile's own (forward and recompute alike)
                lora.mb = (base, "tile", s)
            try:
                return block(xt)
            finally:
                if lora is not None:
                    lora.mb = base

        part = flat[:, s:e]
        y, c = checkpoint(one, part, use_reentrant=False) if grad else one(part)
        ys.append(y)
        caught.append(c)
    y = torch.cat(ys, dim=1).view(x.shape)
    return y, tuple(torch.cat(parts, dim=0) for parts in zip(*caught, strict=True))


def tiled_native(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int, lora: Any
) -> torch.Tensor:
    """The native layer's token-local block fn (h -> h + mlp(norm(h))) over x (b, T, H), tiled."""
    return run_tiled(lambda h: (fn(h), ()), x, tile, lora)[0]


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

        def block(xt: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            prev, outer = caught.pop(i, None), tmpl._lora
            tmpl._lora = lora
            try:
                with _reparametrize_module(mod, bound, strict=False):
                    y = orig(xt)
                got = caught.pop(i, ())
            finally:
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
