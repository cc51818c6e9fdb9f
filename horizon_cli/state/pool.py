"""A release run's host gradient buffers (optim.grad_release, issue 39): a few, not one per unit.

Without release every trained unit has a host gradient of its own, held until the step's clip
norm is known (state.host). With release each unit's update runs as soon as its gradient is whole
(engine.step), so a unit needs a host gradient only from the moment its gradient starts landing
on the host until its update has read it. The pool holds `RELEASE_BUFFERS` flat buffers, each the
size of the largest unit's gradient (in bytes: a layer's in the grad dtype, the embedding's fp32):

    take(st)      the unit's gradient buffer for this step: a free pool buffer (waiting for the
                  update that last read it), viewed as the unit's (numel,) gradient, set as
                  `st.grad`; the one it already holds when taken twice (the tied embedding)
    give(st, ev)  the unit is done with it once `ev` (its update, or READY) has completed; its
                  `st.grad` becomes an empty tensor again, so a stale read fails loudly

Buffers are handed out in turn, skipping those still held, so the one taken is the one whose
update ran first. A taken buffer holds what its last user left: every writer overwrites or zeros it
(engine.grads, engine.embed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from ..optim.modes import RELEASE_BUFFERS
from ..runtime.events import READY, Event


class UnitState(Protocol):  # state.host's, as far as the pool reads and sets it
    name: str
    stream: torch.Tensor
    grad: torch.Tensor


Alloc = Callable[[int, torch.dtype], torch.Tensor]


def empty_grad(dtype: torch.dtype) -> torch.Tensor:
    """A unit's gradient while it holds no pool buffer."""
    return torch.empty(0, dtype=dtype)


class GradPool:
    def __init__(self, units: Mapping[str, UnitState], alloc: Alloc, n: int = RELEASE_BUFFERS):
        """units: the trained units, each `st.grad` already an empty tensor of its gradient dtype."""
        nbytes = max((st.stream.numel() * st.grad.element_size() for st in units.values()), default=0)
        words = -(-nbytes // 4)
        self.bufs = [alloc(words, torch.float32) for _ in range(n)]
        self.free: list[Event] = [READY] * n  # per buffer: the update that last read it
        self.held: dict[str, int] = {}  # unit -> the buffer it holds
        self.next = 0

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs)

    def take(self, st: UnitState) -> torch.Tensor:
        if st.name in self.held:
            return st.grad
        n = len(self.bufs)
        busy = set(self.held.values())
        k = next(((self.next + d) % n for d in range(n) if (self.next + d) % n not in busy), None)
        if k is None:
            raise AssertionError(f"every host gradient buffer is held (taking {st.name})")
        self.next = (k + 1) % n
        self.free[k].host_wait()  # the update that read it last is done
        dtype, numel = st.grad.dtype, st.stream.numel()
        size = torch.tensor([], dtype=dtype).element_size()
        st.grad = self.bufs[k].view(torch.uint8)[: numel * size].view(dtype)
        self.held[st.name] = k
        return st.grad

    def give(self, st: UnitState, done: Event) -> None:
        k = self.held.pop(st.name)
        self.free[k] = done
        st.grad = empty_grad(st.grad.dtype)

    def holds(self, unit: str) -> bool:
        return unit in self.held

    def drop(self) -> None:
        """Forget every holder (a step that stopped half-way): their buffers free once read."""
        self.held.clear()

    def wait(self) -> None:
        for ev in self.free:
            ev.host_wait()
