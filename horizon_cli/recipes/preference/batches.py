"""What a run's steps train on, decided once: rows (SFT), pairs (preference) or KTO examples, as
micro-batches for the engine, and what each adds to a step's metrics.

    SftBatches   a step's train.batch_size rows -> micro-batches of micro_batch_size rows; the
                 engine's default objective (engine.objective.TokenCE)
    PairBatches  a step's train.batch_size pairs -> micro-batches of micro_batch_size whole pairs
                 (data.pairs), with their reference log-probs (train.reference) for dpo/ipo; the
                 pair objective (engine.pref_loss); metrics as TRL logs them, means over the pairs
    KTOBatches   a step's train.batch_size KTO examples (each its completion and a mismatched one,
                 data.unpaired) with their reference log-probs; engine.kto_loss; KTOTrainer's metrics

Both take the step's examples from the sampler (data.sampler: a pure function of seed and step),
so a resumed run sees the batches it would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import torch

from ...config import Config
from ...data import PreparedData, batch_indices, batch_rows, collate
from ...data.batch import IGNORE, MicroBatch
from ...data.pairs import collate_pairs
from ...data.unpaired import collate_unpaired
from ...engine.objective import Objective
from ...errors import InputError
from ..kto.loss import KTOObjective
from .loss import STATS, PairObjective


class SftBatches:
    objective: Objective | None = None  # the engine's default, TokenCE

    def __init__(self, cfg: Config, data: PreparedData):
        self.cfg, self.data = cfg, data

    def prepare(self, reference) -> None:
        """Before step 1 (and on resume): nothing to compute for SFT."""

    def attach(self, engine, store, run_dir, console, main: bool) -> None:
        """Once the engine is built: what a strategy that drives it needs (rl.batches)."""

    def close(self) -> None:
        """When the run ends: what the strategy holds (rl.batches: the reference engine)."""

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


class KTOBatches(PairBatches):
    """A step's train.batch_size KTO examples (data.unpaired: each its completion and a mismatched
    one) -> micro-batches of micro_batch_size whole examples, with their reference log-probs; the
    KTO objective (engine.kto_loss); metrics as TRL's KTOTrainer logs them."""

    def __init__(self, cfg: Config, data: PreparedData):
        SftBatches.__init__(self, cfg, data)
        assert cfg.preference is not None
        self.objective = self.pairs = KTOObjective(cfg.preference)  # type: ignore[assignment]
        self.ref = {}

    def step(self, step: int) -> tuple[list[MicroBatch], int]:
        t = self.cfg.train
        idx = batch_indices(len(self.data.train), step, t.batch_size, t.seed, self.cfg.data.shuffle)
        return self._collate(self.data.train, idx, "train")

    def _eval(self, idx: np.ndarray) -> list[MicroBatch]:
        return self._collate(self.data.eval, idx, "eval")[0]

    def _collate(self, rows, idx: np.ndarray, name: str) -> tuple[list[MicroBatch], int]:
        got = rows.rows(idx)
        mbs = collate_unpaired(
            got, rows.desirable(idx), self.cfg.train.micro_batch_size, self.data.pad_id, self.ref[name][idx]
        )
        return mbs, sum(len(r.input_ids) for r in got)

    def metrics(self, stats: dict[str, float], n: int, prefix: str = "") -> dict:
        """TRL's rewards/chosen, rewards/rejected, logps/* (means over each kind's examples, None
        when the batch has none), rewards/margins (with both), kl (the batch's estimate)."""
        out: dict = {}
        for kind in ("chosen", "rejected"):
            c = stats.get(f"count_{kind}", 0.0)
            for what in ("rewards", "logps"):
                out[f"{prefix}{what}_{kind}"] = stats[f"{what}_{kind}"] / c if c else None
        rc, rr = out[f"{prefix}rewards_chosen"], out[f"{prefix}rewards_rejected"]
        out[f"{prefix}rewards_margin"] = rc - rr if rc is not None and rr is not None else None
        out[f"{prefix}kl"] = stats["kl"] / n if n else None
        return out | ({} if prefix else {"examples": n})

    def show(self, row: dict) -> str:
        kl = row.get("kl")
        return "" if kl is None else f"  kl {kl:.3f}"


def make_batches(cfg: Config, data: PreparedData) -> SftBatches:
    """The strategy for this run; preference data and a preference: section go together."""
    if cfg.rl is not None:  # online RL on prompts (rl.batches)
        from ..grpo.batches import GRPOBatches

        return GRPOBatches(cfg, data)  # type: ignore[return-value]
    kto = cfg.preference is not None and cfg.preference.loss == "kto"
    if kto or data.format == "unpaired":
        if data.format != "unpaired" or not kto:
            raise InputError(
                f"data.path: {cfg.data.path} holds unpaired preference examples (label or kto_tag); train them "
                "with preference: {loss: kto}"
                if not kto
                else f"preference.loss: kto trains on unpaired preference examples (label or kto_tag); "
                f"data.path {cfg.data.path} is format {data.format}"
            )
        return KTOBatches(cfg, data)
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
    """A copy of `mb` with no labels: a rank short of an eval micro-batch runs it and adds nothing
    (an rl micro-batch's row count, its loss's divisor, zero too)."""
    extras = {**mb.extras, "rows": torch.tensor(0)} if "rows" in mb.extras else mb.extras
    return replace(mb, labels=torch.full_like(mb.labels, IGNORE), extras=extras)
