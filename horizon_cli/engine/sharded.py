"""The sharded parts of a step (several ranks, parallel/): gradients reduce-scattered to each rank's
slice, the embedding used and trained on the device, the step's one all-reduce.

    layer i backward   fp32 sum (world * S,) on the device -> reduce-scatter -> this rank's (S,)
                       piece -> its first `end - start` elements to the host grad (narrowed to
                       engine.grad_dtype) -> this rank's CPU AdamW updates its slice
    head               the same, once per step
    embedding          forward: the table is all-gathered into its own device buffer like any
                       unit (the host holds only a slice, so rows cannot be gathered on the host)
                       and rows picked there; backward: rows scatter-added into a dense fp32
                       (V, H) device buffer (with a tied head, the LM head's own gradient already
                       in it), then reduce-scattered like a layer's
    vision tower       a trained tower's gradient (whole on every rank, vision.embed): all-reduced
                       once per step, counted once in the norm; every rank updates its copy alike
    end of step        one all-reduce of (loss sum, sum of squared gradient slices, the objective's
                       stat sums): the global loss, grad norm and metrics, the same on every rank,
                       so every rank clips and skips alike

Every collective goes through the collective thread (parallel.comm), in the order the main thread
issues it, after the events it needs; its result reaches the host over the transport as a
gradient does in a single-rank run. The loss is already divided by the global label count on
every rank, so the reduce-scatter sums and never averages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..parallel.comm import Dist
from ..parallel.shard import SHARD_ALIGN, shard_size
from ..runtime.events import READY, Event, FutureEvent
from ..runtime.transport import Transport
from ..state.host import HostState
from .grads import sumsq64


class ShardedGrads:
    """Reduce-scatter of gradients into host slices, and the step's loss/norm all-reduce."""

    def __init__(
        self,
        dist: Dist,
        transport: Transport,
        host: HostState,
        grad_dtype: torch.dtype,
        replicated: bool = False,
    ):
        """replicated: the trained units are whole on every rank (LoRA's adapters): their
        gradients are all-reduced, and every rank applies the same update to its copy."""
        self.d, self.t, self.host, self.replicated = dist, transport, host, replicated
        per = (lambda n: n) if replicated else (lambda n: shard_size(n, dist.world, SHARD_ALIGN))
        # a forward-only engine (an rl run's reference) trains nothing: empty buffers
        big = max((per(st.layout.numel) for st in host.units.values()), default=0)
        # reduce-scatter outputs: the two layer ping-pong buffers, the head's and the embedding's
        self.keys: tuple[int | str, ...] = (0, 1, "head", "embed")
        self.out = {k: transport.device_empty(big, torch.float32) for k in self.keys}
        narrow = grad_dtype != torch.float32 and not transport.shares_host
        self.wire = {k: transport.device_empty(big, grad_dtype) for k in self.keys} if narrow else {}
        self.free: dict = {}  # key -> the copy that last read its buffers
        self.sq: list[float] = []  # this step's squared norms of this rank's gradient slices
        self.unit_sq: dict[str, float] = {}  # ... by unit (a release run's gate reads them)

    def nbytes(self) -> int:
        bufs = [*self.out.values(), *self.wire.values()]
        return sum(b.numel() * b.element_size() for b in bufs)

    def begin_step(self) -> None:
        self.sq, self.unit_sq = [], {}

    def reduce(self, unit: str, full: torch.Tensor, key: int | str, deps: Sequence[Event] = ()) -> Event:
        """Reduce-scatter `full` (the unit's fp32 gradient sum, (world * S,)) and send this rank's
        slice to its host grad; a replicated unit's: all-reduce it in place and send it whole.
        Returns the event of the slice having landed there."""
        st = self.host[unit]
        n, dst = st.stream.numel(), st.grad
        # the reduced gradient: this rank's piece (sharded) or `full` itself (replicated)
        mine = full[:n] if self.replicated else self.out[key][: full.numel() // self.d.world]
        wire = self.wire[key][:n] if self.wire and dst.dtype != torch.float32 else None
        prev = self.free.get(key, READY)
        direct = self.t.shares_host
        after = [self.t.record(), *deps]

        def job() -> None:
            for ev in after:
                ev.host_wait()
            prev.host_wait()  # the previous slice through these buffers has been copied out
            if self.replicated:  # every rank holds it whole: counted once in the norm
                self.d.all_reduce_sum(full)
                self.unit_sq[unit] = sumsq64(mine)  # adapters: small
                self.sq.append(self.unit_sq[unit] if self.d.is_main else 0.0)
            else:
                self.d.reduce_scatter(mine, full)
                self.sq.append(sumsq64(mine[:n]))
                self.unit_sq[unit] = self.sq[-1]
            if direct:  # no link (the CPU): straight into the host buffer
                dst.copy_(mine[:n])
            elif wire is not None:
                wire.copy_(mine[:n])

        ev: Event = FutureEvent(self.d.submit(job))
        if not direct:
            ev = self.t.d2h([(dst, wire if wire is not None else mine[:n])], [ev], label=f"g-{unit}")
        self.free[key] = ev
        return ev

    def total(self, loss_sum: torch.Tensor, stats: dict | None = None) -> tuple[float, float, dict]:
        """(global loss sum, global squared grad norm, the objective's stat sums over every rank),
        after this step's reduce-scatters: one all-reduce for all of them."""
        keys = list(stats or {})
        loss, sq, *vals = self.sum_all(
            lambda: [float(loss_sum), sum(self.sq), *(float(v) for v in (stats or {}).values())]
        )
        return loss, sq, dict(zip(keys, vals, strict=True))

    def sum_all(self, values: Callable[[], list[float]]) -> list[float]:
        """The sums over ranks of `values()` (evaluated on the collective thread, after every
        collective queued before: the squared norms are all in by then). One all-reduce. The
        collective thread's stream does not follow the compute stream: `values()` reads device
        results (the loss sum) only once the compute issued before this call has completed."""
        made = self.t.record()

        def job() -> list[float]:
            made.host_wait()
            vec = torch.tensor(values(), dtype=torch.float64, device=self.out[0].device)
            self.d.all_reduce_sum(vec)
            return vec.tolist()

        return self.d.submit(job).result()

    def all_sum_tensor(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks in place (after the compute that made it, in collective order)."""
        made = self.t.record()

        def job() -> None:
            made.host_wait()
            self.d.all_reduce_sum(t)

        self.d.submit(job).result()

    def sum_replicated(self, flat: torch.Tensor, sq: Callable[[torch.Tensor], float]) -> None:
        """A gradient every rank holds whole (a vision tower's trained part: vision.embed), flat on
        the device: summed over the ranks in place; `sq(flat)` (its squared norm, the sum's) joins
        the step's once, rank 0's, as a replicated unit's does."""
        made = self.t.record()

        def job() -> None:
            made.host_wait()
            self.d.all_reduce_sum(flat)
            self.sq.append(float(sq(flat)) if self.d.is_main else 0.0)

        self.d.submit(job).result()

    def drain(self) -> None:
        """Wait for every queued collective and the copies behind them."""
        self.d.submit(lambda: None).result()
        for ev in self.free.values():
            ev.host_wait()
