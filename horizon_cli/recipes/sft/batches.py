"""SFT's batches: a step's train.batch_size rows -> micro-batches of micro_batch_size rows for the
engine's default objective (engine.objective.TokenCE); the step's rows from the sampler
(data.sampler: a pure function of seed and step), so a resumed run sees the batches it would have
seen. The other recipes' batches build on it (the eval loop over the held-out set)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from ...config import Config
from ...data import PreparedData, batch_rows, collate
from ...data.batch import MicroBatch
from ...engine.seams import LossObjective
from ..recipe import Attached, Metrics


class SftBatches:
    objective: LossObjective | None = None  # the engine's default, TokenCE

    def __init__(self, cfg: Config, data: PreparedData):
        self.cfg, self.data = cfg, data

    def attach(self, run: Attached) -> None:
        """Nothing to drive: the loop steps the engine."""

    def prepare(self, start: int) -> None:
        """Before step 1 (and on resume): nothing to compute for SFT."""

    def close(self) -> None:
        """Nothing held."""

    def step(self, step: int) -> tuple[list[MicroBatch], int]:
        """The global batch of `step` as micro-batches, and its tokens without padding."""
        t = self.cfg.train
        rows = batch_rows(self.data.train, step, t.batch_size, t.seed, self.cfg.data.shuffle)
        return collate(rows, t.micro_batch_size, self.data.pad_id), sum(len(r.input_ids) for r in rows)

    def eval_batches(self) -> Iterator[list[MicroBatch]]:
        """The held-out examples in order, a global batch at a time (train.eval_batches of them)."""
        ev, t = self.data.eval, self.cfg.train
        n = min(len(ev), t.batch_size * t.eval_batches) if ev is not None else 0
        for a in range(0, n, t.batch_size):
            yield self._eval(np.arange(a, min(n, a + t.batch_size)))

    def _eval(self, idx: np.ndarray) -> list[MicroBatch]:
        assert self.data.eval is not None
        return collate(self.data.eval.rows(idx), self.cfg.train.micro_batch_size, self.data.pad_id)

    def metrics(self, stats: dict[str, float], n: int, prefix: str = "") -> Metrics:
        return {}

    def show(self, row: Mapping[str, object]) -> str:
        return ""
