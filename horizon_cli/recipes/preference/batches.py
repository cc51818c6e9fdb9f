"""Preference batches: a step's train.batch_size pairs -> micro-batches of micro_batch_size whole
pairs (data.pairs), with their reference log-probs (recipes.preference.reference: read back or
computed before step 1) for dpo, cdpo, ipo; the pair objective (recipes.preference.loss); metrics
as TRL logs them, means over the pairs. KTO's batches (recipes.kto) build on these.

The step's pairs come from the sampler (data.sampler: a pure function of seed and step), so a
resumed run sees the batches it would have seen.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from ...config import Config
from ...data import PreparedData, batch_indices
from ...data.batch import MicroBatch
from ...data.pairs import collate_pairs
from ...engine.seams import LossObjective
from ...store import ckpt
from ..recipe import Attached, Metrics
from ..sft.batches import SftBatches
from .loss import STATS, PairObjective
from .reference import reference


class Referenced(LossObjective, Protocol):
    needs_reference: bool  # its batches carry the reference's log-probs (computed before step 1)


class PairBatches(SftBatches):
    def __init__(self, cfg: Config, data: PreparedData, objective: Referenced | None = None):
        super().__init__(cfg, data)
        assert cfg.preference is not None
        self.pairs: Referenced = objective or PairObjective(cfg.preference)
        self.objective = self.pairs
        self.ref: dict[str, np.ndarray] = {}
        self.run: Attached | None = None

    def attach(self, run: Attached) -> None:
        self.run = run

    def prepare(self, start: int) -> None:
        """dpo, cdpo, ipo, kto: the reference log-probs of every pair (computed on a fresh start,
        read back on resume)."""
        if self.pairs.needs_reference:
            run = self.run
            assert run is not None, "attach before prepare"
            fp = ckpt.model_fingerprint(run.store)
            self.ref = reference(
                run.engine, self.data, self.cfg, run.run_dir, run.console, start == 0, fp, run.main
            )

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

    def metrics(self, stats: dict[str, float], n: int, prefix: str = "") -> Metrics:
        """The objective's sums -> means over the `n` pairs (TRL's rewards/*, logps/*)."""
        return {prefix + k: (stats[k] / n if n else None) for k in STATS if k in stats} | (
            {} if prefix else {"pairs": n}
        )

    def show(self, row: Mapping[str, object]) -> str:
        acc, margin = row.get("rewards_accuracy"), row.get("rewards_margin")
        return "" if acc is None else f"  acc {acc:.2f} margin {margin:.3f}"
