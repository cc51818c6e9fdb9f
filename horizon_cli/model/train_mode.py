"""The generic template's train mode: transformers' modules drop (and add router noise) as in training.

A config that turns on dropout or router noise (arch.exceptions.stochastic_keys: GPT-2's
attn / resid / embd_pdrop, Phi's resid_pdrop, Seed-OSS's residual_dropout, a router's jitter)
makes the template `stochastic`. Inside a training call's dropout scope (engine.dropout) every
module of the model is put in train mode, the owner's prefix (the embedding's dropout, in the
first layer's call) included, and back in eval mode after it: transformers' own dropout, its
masks drawn from the generators the scope seeds, so the backward recompute draws them again.
Evaluation, the reference pass and generation run outside any scope: eval mode, dropout off.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from torch import nn

from ..arch.exceptions import stochastic_keys


class ModuleTrainMode:
    """Mixed into model.generic.GenericTemplate (its `model`, transformers' meta-device model,
    `layers`, its decoder layers, `calls`, the layer of each call, and `g`, the store's generic
    description)."""

    model: Any
    layers: list
    calls: list[int]
    g: Any
    dropout_on = False  # a run trains with the model's dropout (engine.dropout sets it)

    @property
    def stochastic(self) -> bool:
        """The store's config turns dropout or noise on."""
        return bool(stochastic_keys(dict(self.g.config)))

    @cached_property
    def _outside(self) -> list[nn.Module]:
        """The modules in no decoder layer: the owner's own (its embedding's dropout), the head's."""
        inside = {id(m) for la in self.layers for m in la.modules()}
        return [m for m in self.model.modules() if id(m) not in inside]

    @cached_property
    def _inside(self) -> list[list[nn.Module]]:
        return [list(la.modules()) for la in self.layers]

    def train_mode(self, on: bool, call: int) -> None:
        """Call `call`'s modules (its layer's, and those outside the layers, which its capture of
        the owner's prefix or a loop's junction may run) in train mode or back in eval mode: what
        `model.train(on)` sets, without nn.Module.__setattr__'s checks (a plain attribute)."""
        for m in (*self._outside, *self._inside[self.calls[call]]):
            object.__setattr__(m, "training", on)
