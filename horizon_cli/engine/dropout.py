"""Dropout (and router noise) as transformers trains it, with masks the backward recompute redraws.

A model whose config turns on dropout (GPT-2's attn / resid / embd_pdrop, Phi's resid_pdrop, a
native layer's attention_dropout) or router noise trains with it, as transformers' modules do in
train mode: every random draw of a training forward comes from the device's (and the CPU's)
default generator, which each layer call, micro-batch by micro-batch, seeds afresh from

    (run seed, optimizer step, call, global micro-batch)

(the global micro-batch: this rank's first one plus its index, so masks do not depend on how
many ranks share the batch). The backward recompute of that call seeds the same way and so draws
the same masks as its forward did (what `torch.utils.checkpoint` gets by saving the RNG state);
a resumed run draws what the uninterrupted one drew (the step is in its checkpoint). LoRA's
adapter dropout keeps generators of its own (lora.linear), seeded from the same quantities.

Around each seeded call the generators' states are saved and put back, and the template runs in
train mode only inside it: evaluation, the reference pass and generation (engine.passes'
ForwardPass) run with dropout off, and nothing else that draws from the global generators sees
a difference. `model.dropout: 0` (or a model without dropout) chooses `NoDropout`: no seeding,
no train mode, the arithmetic of a model without dropout bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..arch import ArchSpec
from ..arch.exceptions import stochastic_keys
from .seams import LayerTemplate

TAG = 0x44524F50  # "DROP": the layers' stream, apart from LoRA's (lora.linear seeds without it)


def call_seed(seed: int, step: int, call: int, mb: int) -> int:
    """The generators' seed for one layer call over one global micro-batch of one step."""
    return hash((TAG, seed, step, call, mb)) & ((1 << 63) - 1)


class NoDropout:
    """Dropout off: the calls run as a model without any (the model has none, or model.dropout: 0)."""

    active = False

    def scope(self, step: int, call: int, mb: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class SeededDropout:
    """Dropout on: each training call over one micro-batch in train mode, the generators seeded."""

    active = True

    def __init__(self, seed: int, tmpl: LayerTemplate, device: torch.device) -> None:
        self.seed, self.tmpl = seed, tmpl
        self.gens = [torch.default_generator]
        if device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            self.gens.append(torch.cuda.default_generators[idx])
        tmpl.dropout_on = True  # what the template prepares for it (native: dense attention masks)

    @contextlib.contextmanager
    def scope(self, step: int, call: int, mb: int) -> Iterator[None]:
        saved = [g.get_state() for g in self.gens]
        s = call_seed(self.seed, step, call, mb)
        for g in self.gens:
            g.manual_seed(s)
        self.tmpl.train_mode(True, call)
        try:
            yield
        finally:
            self.tmpl.train_mode(False, call)
            for g, st in zip(self.gens, saved, strict=True):
                g.set_state(st)


def model_dropout(arch: ArchSpec) -> list[tuple[str, float]]:
    """The model's positive dropout / noise settings by config key (the native layer's: its
    attention's; the generic path's: every such key of its config)."""
    return arch.visit(lambda _: _native_dropout(arch), lambda g: stochastic_keys(dict(g.config)))


def _native_dropout(arch: ArchSpec) -> list[tuple[str, float]]:
    return [("attention_dropout", arch.attn_dropout)] if arch.attn_dropout else []


def dropout_for(tmpl: LayerTemplate, seed: int | None, device: torch.device) -> NoDropout | SeededDropout:
    """SeededDropout when the run trains with dropout (seed: the run's; None: model.dropout: 0)
    and the template's model has any (`tmpl.stochastic`), else NoDropout."""
    if seed is None or not tmpl.stochastic:
        return NoDropout()
    return SeededDropout(seed, tmpl, device)
