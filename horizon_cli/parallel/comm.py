"""The collectives of a sharded run: one process group, and one thread that runs them in order.

Every collective of the training step (a layer's all-gather after its slice reached the device,
a gradient's reduce-scatter after the layer's backward, the step's one all-reduce of the loss
sum and squared grad norm) is queued on a single worker thread, in the order the main thread
issues them. That order is a pure function of the schedule, the same on every rank, so the
ranks' collectives pair up; and because they run on their own thread, waiting on the copies they
follow (events), they overlap the compute as the host <-> device copies do. On CUDA the worker
runs them on its own stream (NCCL); on the CPU (gloo) they are plain blocking calls on the worker.

A collective that cannot complete (a rank died or hung) fails after the process group's timeout
(`Dist.timeout_s`) instead of waiting for ever; torchrun's supervision usually ends it sooner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import HorizonError


@dataclass
class Dist:
    """This process's place in the world, and the queue its collectives run on."""

    world: int
    rank: int
    local_rank: int = 0
    timeout_s: float = 600.0
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)
    _stream: torch.cuda.Stream | None = field(default=None, repr=False)  # the collectives' (CUDA)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- the collective queue (the step's all-gathers, reduce-scatters, all-reduce) -------------
    def start(self, thread_init: Callable[[], None] = lambda: None) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="horizon-comm", initializer=thread_init)

    def submit(self, job: Callable[[], object]) -> Future:
        """Run `job` on the collective thread after every job submitted before it."""
        self.start()
        assert self._pool is not None
        return self._pool.submit(self._run, job)

    def _run(self, job: Callable[[], object]) -> object:
        if self._stream is None and torch.cuda.is_available() and dist.get_backend() == "nccl":
            self._stream = torch.cuda.Stream()
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with ctx:
            out = job()
            if self._stream is not None:
                self._stream.synchronize()  # the event the caller waits on means "done"
        return out

    def stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- the collectives themselves (called on the collective thread, or between steps) ---------
    def all_gather(self, full: torch.Tensor, rank_piece: torch.Tensor) -> None:
        """full = concat of every rank's piece (equal sizes); rank_piece may be full's own part."""
        if self.world > 1:
            self._call("an all-gather", _all_gather, full, rank_piece)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """out = this rank's piece of the sum over ranks of `full` (world equal pieces)."""
        if self.world > 1:
            self._call("a reduce-scatter", _reduce_scatter, out, full)
        else:
            out.copy_(full)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        if self.world > 1:
            self._call("an all-reduce", dist.all_reduce, t)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, on every rank (a few small Python objects: errors, checksums)."""
        out: list = [None] * self.world
        self._call("an all-gather", dist.all_gather_object, out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        box = [obj]
        self._call("a broadcast", dist.broadcast_object_list, box, 0)
        return box[0]

    def barrier(self) -> None:
        self._call("a barrier", dist.barrier)

    def _call(self, what: str, fn: Callable, *args) -> None:
        """A collective; a peer that died or hung becomes one line naming this rank."""
        try:
            fn(*args)
        except RuntimeError as e:  # torch.distributed.DistError and the backends' errors
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = first.split(". ")[0]
            raise HorizonError(
                f"rank {self.rank} of {self.world}: {what} failed, another rank stopped or cannot be "
                f"reached ({first}); resume by launching the run again"
            ) from e


# torch >= 2.10 names them *_single (the *_tensor names warn); older versions have only those
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
