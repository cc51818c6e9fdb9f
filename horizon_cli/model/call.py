"""One call of a layer over one micro-batch, as a value: what the call computes with besides its
weights, its input and the micro-batch's context (engine.seams declares it for the engine's parts).

The engine's passes build one `LayerCall` per (call, micro-batch) and hand it to the layer
template; the template hands it down to the layer's code, and a tiled layer derives one per tile
(`in_tile`). Nothing is written onto a shared object for the call: the LoRA adapters' dropout
masks are keyed by the value (`adapters`: the layer's adapters bound to `key`), so the backward's
recompute, which is handed an equal value, draws the forward's masks.

    key   the micro-batch's global index (this rank's first + its index: masks as on one rank);
          a loop's later calls of a layer (arch.calls) add the call; a tile adds its first token
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Protocol

import torch

MaskKey = int | tuple[object, ...]  # what names a dropout mask besides the seed (lora.linear)
# a tile's part of the key: an int, never a string, since hash() of a str changes with each
# process (PYTHONHASHSEED) and a resumed run must draw the masks the first process drew
TILE = -1


class Lora(Protocol):
    """One layer's LoRA adapters on the device (lora.linear.LayerLora)."""

    ab: dict[str, tuple[torch.Tensor, torch.Tensor]]  # weight name -> (A (r, in), B (out, r))

    def __call__(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...
    def at(self, key: MaskKey) -> Lora: ...  # the same adapters, their dropout masks keyed by `key`


@dataclass(frozen=True)
class LayerCall:
    """Call `call` (of layer `layer`) over global micro-batch `mb` in optimizer step `step`."""

    call: int = 0  # j: its index in the template's sequence of calls (arch.calls)
    layer: int = 0  # i = calls[j] (without a loop, j)
    mb: int = 0  # the global micro-batch
    step: int = 0  # optimizer steps applied (the dropout seeds)
    train: bool = False  # a training pass: LoRA dropout on (the run's setting)
    dropout: bool = False  # ... and the model's own dropout (engine.dropout) drawing in it
    tile: int = 0  # tokens per tile of the layer's token-local parts (engine.seq_tile; 0: untiled)
    at: int | None = None  # inside a tiled run: the tile's first token, counted over the rows
    deferred: bool = False  # the backward's recompute, whose output values are never read
    lora: Lora | None = None  # the layer's adapters (None: none)

    @property
    def key(self) -> MaskKey:
        """What names this call's dropout masks (module doc)."""
        base: MaskKey = self.mb if self.call == self.layer else (self.mb, self.call)
        return base if self.at is None else (base, TILE, self.at)

    @cached_property
    def adapters(self) -> Lora | None:
        """The layer's adapters with this call's masks (computed once per value)."""
        return None if self.lora is None else self.lora.at(self.key)

    def in_tile(self, first: int) -> LayerCall:
        """The call of the tile whose first token (over the rows) is `first`."""
        return replace(self, at=first)

    def recompute(self) -> LayerCall:
        """The backward's recompute of this call (its output values unread)."""
        return replace(self, deferred=True)
