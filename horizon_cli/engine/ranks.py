"""Where a run's processes stand, decided once from its rank (`ranks_for`): one process, or one
rank of a sharded run (parallel.comm.Dist). train/ asks this object, never whether it is sharded.

    share(mbs)        this rank's contiguous share of a global batch's micro-batches
    eval_share(mbs, pad)  held-out micro-batches dealt round-robin, a short rank padded with
                      pad(the first): a copy without labels (every rank must run the same loads and collectives)
    part(n)           this rank's contiguous part [lo, hi) of n items (an rl step's prompts)
    gather(obj)       every rank's obj, in rank order (small Python objects: an rl step's rollouts)
    first(fn)         fn on rank 0, then on the others (rank 0 fills what they read)
    fewest(k)         the least of every rank's k (their schedules must match)
    sliced, replicated  the placement of state that each rank holds a slice of, or a copy of
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeVar, cast

from ..data.batch import MicroBatch
from ..errors import HorizonError, InputError
from ..parallel.comm import Dist

T = TypeVar("T")
Pad = Callable[[MicroBatch], MicroBatch]  # a micro-batch that adds nothing (a copy without labels)


class Placement(enum.Enum):
    """How state lies over the processes."""

    WHOLE = "whole"  # one process holds all of it
    REPLICATED = "replicated"  # every rank holds the same copy (rank 0 writes it)
    SLICED = "sliced"  # every rank holds its slice (each writes its own)


class OneProcess:
    comm: Dist | None = None
    is_main = True
    rank, world = 0, 1
    sliced = replicated = Placement.WHOLE

    def share(self, mbs: list[MicroBatch]) -> list[MicroBatch]:
        return mbs

    def eval_share(self, mbs: list[MicroBatch], pad: Pad) -> list[MicroBatch]:
        return mbs

    def part(self, n: int) -> tuple[int, int]:
        return 0, n

    def gather(self, obj: T) -> list[T]:
        return [obj]

    def first(self, fn: Callable[[], T]) -> T:
        return fn()

    def fewest(self, k: int) -> int:
        return k

    def describe(self) -> str:
        return ""


class ShardedRanks:
    sliced, replicated = Placement.SLICED, Placement.REPLICATED

    def __init__(self, comm: Dist):
        self.comm = comm
        self.is_main = comm.is_main
        self.rank, self.world = comm.rank, comm.world

    def share(self, mbs: list[MicroBatch]) -> list[MicroBatch]:
        k = len(mbs) // self.world
        return mbs[self.rank * k : (self.rank + 1) * k]

    def eval_share(self, mbs: list[MicroBatch], pad: Pad) -> list[MicroBatch]:
        k = -(-len(mbs) // self.world)
        mine = mbs[self.rank :: self.world]
        while len(mine) < k:
            mine.append(pad(mbs[0]))
        return mine

    def part(self, n: int) -> tuple[int, int]:
        """Rank r's items r n / world ... (r + 1) n / world: in rank order, a few more or less each."""
        return self.rank * n // self.world, (self.rank + 1) * n // self.world

    def gather(self, obj: T) -> list[T]:
        """On the collective thread, after every collective queued before it (a sweep's gathers)."""
        return cast(list[T], self.comm.submit(lambda: self.comm.gather_objects(obj)).result())

    def first(self, fn: Callable[[], T]) -> T:
        return main_first(self.comm, fn)

    def fewest(self, k: int) -> int:
        return min(self.comm.gather_objects(k))

    def describe(self) -> str:
        return f", rank {self.rank} of {self.world} (host state per rank)"


Ranks = OneProcess | ShardedRanks


def ranks_for(dist: Dist | None) -> Ranks:
    return OneProcess() if dist is None else ShardedRanks(dist)


def main_first(d: Dist, fn: Callable[[], T]) -> T:
    """fn on rank 0, then on the others (rank 0 fills what they read: the data cache). Rank 0's
    error stops every rank with the same line and exit status, instead of the others' "a
    collective failed" when rank 0 leaves."""
    if d.is_main:
        try:
            out = fn()
        except HorizonError as e:
            d.broadcast_object((isinstance(e, InputError), str(e)))
            raise
        d.broadcast_object((None, ""))
        return out
    bad, msg = d.broadcast_object(None)
    if bad is not None:
        raise (InputError if bad else HorizonError)(msg)
    return fn()
