"""The objective's step statistics combine by their kind (engine.stats): sums add up, a MIN or MAX
statistic (GRPO's clip_ratio/low_min, /high_max) is the least or the most over the ranks and over
an evaluation's batches, NaN left out as TRL's nanmin / nanmax leave it out. Over ranks the values
ride one all-reduce sum (each rank's at its own place), simulated here by adding the ranks' vectors."""

from __future__ import annotations

import math

import torch

from horizon_cli.engine.stats import Reduction, combine, gathered, spread
from horizon_cli.recipes.grpo.loss import GRPOObjective

KINDS = {"lo": Reduction.MIN, "hi": Reduction.MAX}


def _over_ranks(per_rank: list[dict]) -> dict[str, float]:
    """What ShardedReduce gets back: the ranks' spread vectors summed (the all-reduce), gathered."""
    world = len(per_rank)
    vecs = [[float(v) for v in spread(s, KINDS, r, world)] for r, s in enumerate(per_rank)]
    summed = [sum(col) for col in zip(*vecs, strict=True)]
    return gathered(per_rank[0], summed, KINDS, world)


def test_min_and_max_cross_the_ranks_by_their_kind_and_sums_add_up():
    ranks = [
        {"n": torch.tensor(3.0), "lo": torch.tensor(0.25), "hi": torch.tensor(math.nan)},
        {"n": torch.tensor(4.0), "lo": torch.tensor(math.nan), "hi": torch.tensor(0.5)},
        {"n": torch.tensor(1.0), "lo": torch.tensor(0.75), "hi": torch.tensor(0.125)},
    ]
    assert _over_ranks(ranks) == {"n": 8.0, "lo": 0.25, "hi": 0.5}  # a sum would give 1.0 and NaN
    nothing = [{"n": 1.0, "lo": math.nan, "hi": math.nan}] * 2  # no rank had a completion with tokens
    got = _over_ranks(nothing)
    assert got["n"] == 2.0 and math.isnan(got["lo"]) and math.isnan(got["hi"])


def test_an_evaluations_batches_combine_by_kind():
    a = {"n": 2.0, "lo": 0.5, "hi": 0.25}
    b = {"n": 3.0, "lo": 0.125, "hi": math.nan}
    assert combine(KINDS, combine(KINDS, {}, a), b) == {"n": 5.0, "lo": 0.125, "hi": 0.25}


def test_grpo_names_its_least_and_most():
    assert GRPOObjective.reductions == {"clip_low_min": Reduction.MIN, "clip_high_max": Reduction.MAX}
