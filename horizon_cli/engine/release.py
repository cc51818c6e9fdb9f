"""Gradient release (optim.grad_release, issue 39): each unit's AdamW inside the backward.

The training step (engine.step) tells its `release` each unit whose gradient is whole on the host
(the head first, then the layers from the top, the embedding last). `NoRelease` does nothing: the
engine then updates every unit after the backward, as without release. `Release`:

    h given      the unit's update is queued on the optimizer thread at once, behind its gradient's
                 landing, overlapping the backward below; its pool buffer (state.pool) is free
                 once the update has read it; the next forward waits on the update (loader.ready)
    h None       a norm-first pass's measuring backward (optim.grad_clip > 0): nothing is updated,
                 the buffer is free once the gradient has landed (only its squared norm is kept)

Each update is gated (`gate`): the step's loss and the unit's gradient must be finite (its squared
norm, the pieces the reduce took). A unit that fails closes the gate: it and every unit after it
are refused. `applied` names the units updated; a step whose gate closed after some were is one
the engine stops on (engine.engine), since they cannot be undone.
"""

from __future__ import annotations

import math

import torch

from ..optim.adamw import AdamWHyper
from ..runtime.events import Event
from .grads import Chunk
from .parts import Parts


class NoRelease:
    """Without release: every unit is updated after the backward (Engine.step, apply_update)."""

    loss: torch.Tensor | None = None

    def unit(self, unit: str, landed: Event, pieces: list[torch.Tensor]) -> None:
        pass

    def chunks(self, unit: str, pieces: list[torch.Tensor]) -> Chunk:
        """A one-rank release run's chunk taker for `unit` (engine.grads.send_chunks): here none
        is read, each buffer is free once landed (no pass without release sends chunks)."""
        return lambda a, b, buf, landed: landed

    def rest(self, ready: dict[str, Event], host_sq: float) -> None:
        pass


class Release(NoRelease):
    def __init__(self, p: Parts, h: AdamWHyper | None):
        self.p, self.h = p, h
        self.done: set[str] = set()
        self.closed = False  # a unit was refused: so is every later one
        self.refused: str | None = None  # the first unit refused
        self.applied: list[str] = []  # units updated (on the optimizer thread)
        self.queued: dict[str, Event] = {}  # unit -> its last chunk's update (one rank)

    def unit(self, unit: str, landed: Event, pieces: list[torch.Tensor]) -> None:
        """`unit`'s gradient is whole; it lands on the host with `landed`."""
        p, host = self.p, self.p.params.host
        self.done.add(unit)
        done = landed
        if self.h is not None:
            done = self.queued.get(unit) or p.optimizer.release(
                unit, self.h, landed, lambda: self.admit(unit, pieces), self.applied
            )
            p.loader.ready[unit] = done
        if host.pool is not None and host.pool.holds(unit):
            host.pool.give(host[unit], done)

    def chunks(self, unit: str, pieces: list[torch.Tensor]) -> Chunk:
        """The chunk taker of `unit` (one rank, engine.grads.send_chunks): each chunk's slices are
        updated once it has landed, gated as a whole unit is (`admit`); a measuring pass's
        buffers are free once landed."""

        def take(a: int, b: int, buf: torch.Tensor, landed: Event) -> Event:
            if self.h is None:
                return landed
            gate = lambda: self.admit(unit, pieces)  # noqa: E731
            ev = self.p.optimizer.release(unit, self.h, landed, gate, self.applied, buf, a)
            self.queued[unit] = ev
            return ev

        return take

    def rest(self, ready: dict[str, Event], host_sq: float) -> None:
        """After the embedding's backward: the units not yet released (the embedding)."""
        for unit, ev in ready.items():
            if unit not in self.done:
                self.unit(unit, ev, [torch.tensor(host_sq, dtype=torch.float64)])

    def admit(self, unit: str, pieces: list[torch.Tensor]) -> bool:
        """On the optimizer thread, once the unit's gradient has landed: update it?"""
        if not self.closed:
            loss = self.loss
            finite = loss is None or math.isfinite(float(loss))
            if not (finite and math.isfinite(self.p.reduce.unit_sq(unit, pieces))):
                self.closed, self.refused = True, unit
        return not self.closed

    def refuse(self) -> None:
        """The step is not finite: refuse every update not yet begun."""
        if not self.closed:
            self.closed, self.refused = True, self.refused or "(none: the loss)"
