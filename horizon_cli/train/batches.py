"""What a run's steps train on, decided once: rows (SFT) or pairs (preference), as micro-batches
for the engine, and what each adds to a step's metrics.

    SftBatches   a step's train.batch_size rows -> micro-batches of micro_batch_size rows; the
                 engine's default objective (engine.objective.TokenCE)
    PairBatches  a step's train.batch_size pairs -> micro-batches of micro_batch_size whole pairs
                 (data.pairs), with their reference log-probs (train.reference) for dpo/ipo; the
                 pair objective (engine.pref_loss); metrics as TRL logs them, means over the pairs

Both take the step's examples from the sampler (data.sampler: a pure function of seed and step),
so a resumed run sees the batches it would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import torch

from ..config import Config
from ..data import PreparedData, batch_indices, batch_rows, collate
from ..data.batch import IGNORE, MicroBatch
from ..data.pairs import collate_pairs
from ..engine.objective import Objective
from ..engine.pref_loss import STATS, PairObjective
from ..errors import InputError


class SftBatches:
    objective: Objective | None = None  # the engine's default, TokenCE

    def __init__(self, cfg: Config, data: PreparedData):
        self.cfg, self.data = cfg, data

    def prepare(self, reference) -> None:
        """Before step 1 (and on resume): nothing to compute for SFT."""

    def step(self, step: int) -> tuple[list[MicroBatch], int]:
        """The global batch of `step` as micro-batches, and its tokens without padding."""
        t = self.cfg.train
        rows = batch_rows(self.data.train, step, t.batch_size, t.seed, self.cfg.data.shuffle)  # type: ignore[arg-type]
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

    def metrics(self, stats: dict[str, float], n: int, prefix: str = "") -> dict:
        return {}

    def show(self, row: dict) -> str:
        return ""


class PairBatches(SftBatches):
    def __init__(self, cfg: Config, data: PreparedData):
        super().__init__(cfg, data)
        assert cfg.preference is not None
        self.objective = self.pairs = PairObjective(cfg.preference)
        self.ref: dict[str, np.ndarray] = {}

    def prepare(self, reference) -> None:
        """dpo, ipo: the reference log-probs of every pair (`reference()`: read back or computed)."""
        if self.pairs.needs_reference:
            self.ref = reference()

    def step(self, step: int) -> tuple[list[MicroBatch], int]:
        t = self.cfg.train
        idx = batch_indices(len(self.data.train), step, t.batch_size, t.seed, self.cfg.data.shuffle)
        rows = self.data.train.rows(idx)
        ref = self.ref["train"][idx] if self.ref else None
        return collate_pairs(rows, t.micro_batch_size, self.data.pad_id, ref), sum(
            len(r.input_ids) for r in rows
        )

    def _eval(self, idx: np.ndarray) -> list[MicroBatch]:
        assert self.data.eval is not None
        ref = self.ref["eval"][idx] if self.ref else None
        return collate_pairs(self.data.eval.rows(idx), self.cfg.train.micro_batch_size, self.data.pad_id, ref)

    def metrics(self, stats: dict[str, float], n: int, prefix: str = "") -> dict:
        """The objective's sums -> means over the `n` pairs (TRL's rewards/*, logps/*)."""
        return {prefix + k: (stats[k] / n if n else None) for k in STATS if k in stats} | (
            {} if prefix else {"pairs": n}
        )

    def show(self, row: dict) -> str:
        acc, margin = row.get("rewards_accuracy"), row.get("rewards_margin")
        return "" if acc is None else f"  acc {acc:.2f} margin {margin:.3f}"


def make_batches(cfg: Config, data: PreparedData) -> SftBatches:
    """The strategy for this run; preference data and a preference: section go together."""
    pairs = data.format == "preference"
    if cfg.preference is not None and not pairs:
        raise InputError(
            f"preference.loss: {cfg.preference.loss} trains on preference pairs (chosen, rejected); "
            f"data.path {cfg.data.path} is format {data.format} (data.format: preference reads pairs)"
        )
    if pairs and cfg.preference is None:
        raise InputError(
            f"data.path: {cfg.data.path} holds preference pairs (format preference); add a preference: "
            "section to train on them (e.g. preference: {loss: dpo})"
        )
    return PairBatches(cfg, data) if pairs else SftBatches(cfg, data)


def unlabelled(mb: MicroBatch) -> MicroBatch:
    """A copy of `mb` with no labels: a rank short of an eval micro-batch runs it and adds nothing."""
    return replace(mb, labels=torch.full_like(mb.labels, IGNORE))
