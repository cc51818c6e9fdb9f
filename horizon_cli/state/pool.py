"""A release run's host gradient buffers (optim.grad_release, issue 39): a few, not one per unit.

Without release every trained unit has a host gradient of its own, held until the step's clip
norm is known (state.host). With release each unit's update runs as soon as its gradient is whole
(engine.step), so a unit needs a host gradient only from the moment its gradient starts landing
on the host until its update has read it.

One rank (`ChunkPool`): `RELEASE_CHUNKS` buffers of `RELEASE_CHUNK` elements of the grad dtype
(fewer when the largest unit is smaller). A unit's gradient crosses in chunks (state.slices.spans),
each into the next buffer once the update that last read it is done, and each chunk's slices are
updated as soon as it has landed (engine.grads.send_chunks); a chunk's copy waits for its buffer
on the copy thread, so the backward goes on to the next layer meanwhile. The host holds ~200 MiB of
gradients whatever the model, besides the embedding's fp32 gradient (the host adds the input
gradient into it row by row), a buffer of its own as without release: an untied table's holds the
rows the step touched (state.host `UnitState.rows`).

Several ranks (`GradPool`): each rank's slice of a unit arrives whole from a reduce-scatter, into
one of `RELEASE_BUFFERS` flat buffers, each the size of the largest slice's gradient (in bytes: a
layer's in the grad dtype, the embedding's fp32):

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

from ..optim.modes import RELEASE_BUFFERS, RELEASE_CHUNK, RELEASE_CHUNKS
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


class ChunkPool:
    """One rank's release buffers: fixed-size chunks (module doc); the embedding's gradient is not
    in them (its own buffer), every other unit's exists only in chunks (state.host: `chunks`)."""

    def __init__(
        self,
        units: Mapping[str, UnitState],
        alloc: Alloc,
        dtype: torch.dtype,
        chunk: int | None = None,
        n: int = RELEASE_CHUNKS,
    ):
        """chunk: elements a buffer holds at most (default RELEASE_CHUNK, read at the call)."""
        chunk = RELEASE_CHUNK if chunk is None else chunk
        largest = max((st.stream.numel() for name, st in units.items() if name != "embed"), default=0)
        self.elems = min(largest, chunk)  # spans (state.slices) are at most this long
        self.bufs = [alloc(self.elems, dtype) for _ in range(n)]
        self.free: list[Event] = [READY] * n  # per buffer: the update that last read it
        self.next = 0

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs)

    def chunk(self, numel: int) -> tuple[int, torch.Tensor, Event]:
        """The next buffer: (k, its first `numel` elements, the event it is free after: the update
        that read it last). The writer waits on that event (a copy takes it as a dependency, so
        the thread handing out chunks never blocks); hand the buffer back at once with
        `give_chunk(k, ev)`, ev: when its new reader is done."""
        k = self.next
        self.next = (k + 1) % len(self.bufs)
        return k, self.bufs[k][:numel], self.free[k]

    def give_chunk(self, k: int, done: Event) -> None:
        self.free[k] = done
