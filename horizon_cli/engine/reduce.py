"""Where a step's gradients go, decided once: one process (LocalReduce) or several ranks
(ShardedReduce).

    layer(unit, g, k, sq, chunks)  a unit's fp32 gradient sum on the device -> its host grad;
                            returns the event of its landing there (the optimizer waits on it);
                            a one-rank release run sends it in chunks, each given to
                            `chunks(unit, pieces)` (engine.release) as it is queued
    head(...)               the same for the head once per step (and a tied embedding's share)
    total(loss, sq, host, stats)  the step's loss sum, squared grad norm and the objective's stats:
                            this process's, or every rank's (one all-reduce; a MIN or MAX stat by
                            its kind, engine.stats), so every rank clips and skips alike
    eval_total(sum, n, stats)  an evaluation's (loss sum, divisor, stats), over every rank
    sum_vector(v)           a small host vector summed over the ranks (the reference pass's)
    drain()                 wait for every queued reduction (before eval or save)

Local: the squares of the device pieces are summed in fp64 on the host with the embedding's.
Sharded (engine.sharded): gradients are reduce-scattered to each rank's slice (LoRA's replicated
adapters all-reduced, counted once), the squares taken on the collective thread.
"""

from __future__ import annotations

import torch

from ..runtime.events import Event
from ..runtime.transport import Transport
from ..state.host import HostState
from .grads import Chunks, GradSums, sumsq
from .sharded import ShardedGrads
from .stats import Kinds, gathered, spread

Stats = dict[str, torch.Tensor]  # an objective's sums over this rank's data


class LocalReduce:
    def __init__(self, transport: Transport, host: HostState, grads: GradSums, tied: bool):
        self.t, self.host, self.grads, self.tied = transport, host, grads, tied

    def begin_step(self) -> None:
        pass

    def layer(self, unit: str, g: torch.Tensor, k: int, sq: list, chunks: Chunks) -> Event:
        return self._send(unit, g, k, sq, chunks)

    def _send(self, unit: str, g: torch.Tensor, k: int | None, sq: list, chunks: Chunks) -> Event:
        """A unit's sum to the host, its squared norm's pieces into `sq`. k: the wire buffer a
        narrowed sum goes through (None: a temporary, the head's)."""
        n = len(sq)
        sq.extend(sumsq(g))
        if self.grads.chunked:  # release: the sum crosses in chunks, each updated as it lands
            return self.grads.send_chunks(unit, g, k, chunks(unit, sq[n:]))
        return self.grads.send(unit, g, k)

    def head(self, grads: GradSums, ready: dict[str, Event], sq: list, chunks: Chunks) -> None:
        """The head's gradient (a tied LM head's share first, into the embedding's host grad,
        which the embedding's backward then adds its rows to)."""
        assert grads.head is not None
        if self.tied and not self.t.shares_host:
            assert grads.embed is not None  # a tied head's share lands in the embedding's
            dst = self.host.take("embed")  # release: held until the embedding's rows are in
            ready["embed"] = self.t.d2h([(dst, grads.embed)], [self.t.record()], "g-lm")
        ready["head"] = self._send("head", grads.head, None, sq, chunks)

    def total(
        self, loss_sum: torch.Tensor, sq: list, host_sq: float, stats: Stats
    ) -> tuple[float, float, dict]:
        dev_sq = torch.stack(sq).double().sum().item() if sq else 0.0
        return float(loss_sum.item()), dev_sq + host_sq, {k: float(v) for k, v in stats.items()}

    def eval_total(self, total: torch.Tensor, tokens: int, stats: Stats) -> tuple[float, int, dict]:
        return float(total.item()), tokens, {k: float(v) for k, v in stats.items()}

    def sum_vector(self, v: torch.Tensor) -> torch.Tensor:
        return v

    def drain(self) -> None:
        pass

    def unit_sq(self, unit: str, pieces: list[torch.Tensor]) -> float:
        """A unit's squared gradient norm from its pieces (`layer`'s, once it has landed)."""
        return float(torch.stack(pieces).double().sum()) if pieces else 0.0


class ShardedReduce:
    def __init__(self, sharded: ShardedGrads, kinds: Kinds | None = None):
        """kinds: the objective's statistics that are not sums (Objective.reductions)."""
        self.sharded, self.kinds = sharded, kinds or {}

    def begin_step(self) -> None:
        self.sharded.begin_step()

    def layer(self, unit: str, g: torch.Tensor, k: int, sq: list, chunks: Chunks) -> Event:
        self.sharded.host.take(unit)  # release: its slice's host buffer (state.pool)
        return self.sharded.reduce(unit, g, k)

    def head(self, grads: GradSums, ready: dict[str, Event], sq: list, chunks: Chunks) -> None:
        # a tied LM head's gradient stays in the embedding's device buffer and goes with it
        assert grads.head is not None
        self.sharded.host.take("head")
        ready["head"] = self.sharded.reduce("head", grads.head, "head")

    def total(
        self, loss_sum: torch.Tensor, sq: list, host_sq: float, stats: Stats
    ) -> tuple[float, float, dict]:
        loss, norm_sq, summed = self.sharded.total(loss_sum, self._spread(stats))
        return loss, norm_sq, gathered(stats, list(summed.values()), self.kinds, self.sharded.d.world)

    def eval_total(self, total: torch.Tensor, tokens: int, stats: Stats) -> tuple[float, int, dict]:
        """This rank's share: the sums over every rank's (a MIN or MAX stat by its kind)."""
        mine = self._spread(stats)
        loss, n, *vals = self.sharded.sum_all(
            lambda: [float(total), float(tokens), *map(float, mine.values())]
        )
        return loss, int(n), gathered(stats, vals, self.kinds, self.sharded.d.world)

    def _spread(self, stats: Stats) -> dict:
        d = self.sharded.d
        return dict(enumerate(spread(stats, self.kinds, d.rank, d.world)))

    def sum_vector(self, v: torch.Tensor) -> torch.Tensor:
        """Every rank's v added up (each rank fills its own entries, zeros elsewhere: exact)."""
        return torch.tensor(self.sharded.sum_all(lambda: v.double().tolist()), dtype=v.dtype)

    def drain(self) -> None:
        self.sharded.drain()

    def unit_sq(self, unit: str, pieces: list[torch.Tensor]) -> float:
        """This rank's slice's squared norm (taken on the collective thread before it landed)."""
        return self.sharded.unit_sq.get(unit, 0.0)
