"""KTO's batches: a step's train.batch_size KTO examples (data.unpaired: each its completion and a
mismatched one) -> micro-batches of micro_batch_size whole examples, with their reference log-probs
(recipes.preference.reference, read back or computed before step 1); the KTO objective
(recipes.kto.loss); metrics as TRL's KTOTrainer logs them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import numpy as np

from ...config import Config
from ...data import PreparedData, batch_indices
from ...data.batch import MicroBatch
from ...data.pairs import PairSet
from ...data.unpaired import collate_unpaired
from ..preference.batches import PairBatches
from ..recipe import Metrics
from .loss import KTOObjective


class KTOBatches(PairBatches):
    def __init__(self, cfg: Config, data: PreparedData):
        assert cfg.preference is not None
        super().__init__(cfg, data, KTOObjective(cfg.preference))

    def step(self, step: int) -> tuple[list[MicroBatch], int]:
        t = self.cfg.train
        idx = batch_indices(len(self.data.train), step, t.batch_size, t.seed, self.cfg.data.shuffle)
        return self._collate(cast(PairSet, self.data.train), idx, "train")  # the recipe's form: unpaired

    def _eval(self, idx: np.ndarray) -> list[MicroBatch]:
        assert self.data.eval is not None
        return self._collate(cast(PairSet, self.data.eval), idx, "eval")[0]

    def _collate(self, rows: PairSet, idx: np.ndarray, name: str) -> tuple[list[MicroBatch], int]:
        got = rows.rows(idx)
        mbs = collate_unpaired(
            got, rows.desirable(idx), self.cfg.train.micro_batch_size, self.data.pad_id, self.ref[name][idx]
        )
        return mbs, sum(len(r.input_ids) for r in got)

    def metrics(self, stats: dict[str, float], n: int, prefix: str = "") -> Metrics:
        """TRL's rewards/chosen, rewards/rejected, logps/* (means over each kind's examples, None
        when the batch has none), rewards/margins (with both), kl (the batch's estimate)."""
        out: Metrics = {}
        for kind in ("chosen", "rejected"):
            c = stats.get(f"count_{kind}", 0.0)
            for what in ("rewards", "logps"):
                out[f"{prefix}{what}_{kind}"] = stats[f"{what}_{kind}"] / c if c else None
        rc, rr = out[f"{prefix}rewards_chosen"], out[f"{prefix}rewards_rejected"]
        out[f"{prefix}rewards_margin"] = rc - rr if rc is not None and rr is not None else None
        out[f"{prefix}kl"] = stats["kl"] / n if n else None
        return out | ({} if prefix else {"examples": n})

    def show(self, row: Mapping[str, object]) -> str:
        kl = row.get("kl")
        return "" if kl is None else f"  kl {kl:.3f}"
