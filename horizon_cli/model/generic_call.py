"""The call a generic layer's modules compute for: LoRA's hooks on transformers' linear modules,
and sequence tiles (`engine.seq_tile`, model.tiling) of a layer's token-local blocks (arch.tiling).

transformers' layer code calls its block (`self.mlp(hidden_states)`) and its linear modules with
tensors only, so the call a layer runs for (model.call.LayerCall: its LoRA adapters and their
masks, its tile) reaches the modules inside through one `CallSlot` of the template: bound around
the layer's functional_call and, per tile, around the tile's block; the hooks read it there (the
module runs with the streamed weights through functional_call, the hook stays).

`TiledBlock` stands at the block's place in the meta template layer: a module of its own class
(not a patched forward) that shares the block's parameters, buffers, submodules and hooks, so
every name functional_call binds and every hook stays where it was; its forward runs the block
in tiles (model.tiling.run_tiled), each tile with the tensors bound at call time (its
checkpointed recompute runs in the backward, after the functional_call has returned), its call's
train or eval mode, and the router outputs the template's hooks catch, concatenated over tiles.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from ..arch.generic_arch import GenericArch
from ..arch.tiling import blocks
from .call import LayerCall
from .tiling import run_tiled

Caught = dict[int, tuple[torch.Tensor, ...]]  # layer -> its router's outputs (model.generic's hooks)


class CallSlot:
    """The call a generic layer's modules compute for, while they do (None between calls)."""

    def __init__(self) -> None:
        self.now: LayerCall | None = None

    @contextmanager
    def bound(self, call: LayerCall) -> Iterator[None]:
        prev, self.now = self.now, call
        try:
            yield
        finally:
            self.now = prev

    def adapt(self, weight: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A LoRA hook's output: y plus the adapter of `weight` of the call being computed (none
        outside a layer's call, as in the owner's prefix)."""
        lora = None if self.now is None else self.now.adapters
        return y if lora is None else lora(weight, x, y)

    def hook(self, mod: nn.Module, weight: str) -> None:
        """LoRA on transformers' own linear module `mod` (adapted weight `weight`): a forward hook
        adds the call's adapter output."""

        def adapt(_mod: nn.Module, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
            return self.adapt(weight, inp[0], out)

        mod.register_forward_hook(adapt)


_SHARED = (  # what a TiledBlock shares with its block: every name, tensor and hook stays the block's
    "_parameters",
    "_buffers",
    "_modules",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


class TiledBlock(nn.Module):
    """Layer i's token-local block `inner`, run in tiles of the slot's call (module doc)."""

    def __init__(self, inner: nn.Module, i: int, slot: CallSlot, caught: Caught) -> None:
        super().__init__()
        for name in _SHARED:  # the block's own dicts: the same names, tensors bound, hooks
            object.__setattr__(self, name, getattr(inner, name))
        object.__setattr__(self, "inner", inner)  # not a child: no name of its own
        self.inner: nn.Module
        self.i, self.slot, self.caught = i, slot, caught

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        given = [*args, *kwargs.values()]
        call, inner = self.slot.now, self.inner
        object.__setattr__(inner, "training", self.training)  # train_mode reaches this module, not it
        if call is None or call.tile <= 0 or len(given) != 1 or not isinstance(given[0], torch.Tensor):
            return inner.forward(*args, **kwargs)
        bound = {**dict(inner.named_parameters()), **dict(inner.named_buffers())}
        # train or eval mode as at this call (engine.dropout's scope): a tile's checkpointed
        # recompute runs in the backward, after the scope has put the modules back in eval mode
        modes = [(inner, self.training)] + [(m, m.training) for m in inner.modules() if m is not inner]

        def block(xt: torch.Tensor, c: LayerCall) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            prev = self.caught.pop(self.i, None)
            was = [m.training for m, _ in modes]
            for m, on in modes:
                m.training = on
            try:
                with self.slot.bound(c), _reparametrize_module(inner, bound, strict=False):
                    y = inner.forward(xt)
                got = self.caught.pop(self.i, ())
            finally:
                for (m, _), on in zip(modes, was, strict=True):
                    m.training = on
                if prev is not None:
                    self.caught[self.i] = prev
            if not isinstance(y, torch.Tensor):
                raise RuntimeError(
                    f"layer {self.i}: its token-local block returns a {type(y).__name__}, not a tensor"
                )
            return y, tuple(got)

        y, got = run_tiled(block, given[0], call)
        if got:
            self.caught[self.i] = got
        return y


def tile_blocks(g: GenericArch, layers: list[nn.Module], tile: int, slot: CallSlot, caught: Caught) -> None:
    """With tiles (tile > 0), a TiledBlock in place of each token-local block (arch.tiling) of
    each of the template's layers."""
    if tile <= 0:
        return
    found = blocks(g)
    for i, layer in enumerate(layers):
        for name in found.get(g.layer_kinds[i], ()):
            layer.register_module(name, TiledBlock(layer.get_submodule(name), i, slot, caught))
