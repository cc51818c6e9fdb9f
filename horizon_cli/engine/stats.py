"""How an objective's step statistics combine: over a rank's micro-batches the objective computes
them itself, from every micro-batch at once (engine.objective); over the ranks (engine.reduce) and
over an evaluation's batches (train.loop) each by its kind.

    SUM   most: a metric such as TRL's clip_ratio/low_mean is a sum over a count, both summed
    MIN   the least of per-item values (TRL's nanmin over the completions: clip_ratio/low_min)
    MAX   the most (TRL's nanmax: clip_ratio/high_max)

An objective names its non-sum statistics (Objective.reductions); any other is a sum. A MIN or
MAX statistic is NaN where there was nothing to take it over, and NaN is left out when combined
(TRL's nanmin / nanmax). Over the ranks everything goes in one all-reduce sum: a MIN or MAX
statistic takes `world` entries, this rank's value at its own place and 0 at the others, so the
sum lays every rank's value side by side, exactly (x + 0 = x, NaN included).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from enum import Enum

import torch


class Reduction(Enum):
    SUM = "sum"
    MIN = "min"
    MAX = "max"

    def of(self, values: Iterable[float]) -> float:
        """The values combined (MIN, MAX: NaN left out; NaN when nothing is left)."""
        vals = list(values)
        if self is Reduction.SUM:
            return sum(vals)
        kept = [v for v in vals if not math.isnan(v)]
        if not kept:
            return math.nan
        return min(kept) if self is Reduction.MIN else max(kept)


Kinds = Mapping[str, Reduction]  # a statistic's kind by name; one not named is a sum


def kind_of(kinds: Kinds, name: str) -> Reduction:
    return kinds.get(name, Reduction.SUM)


def combine(kinds: Kinds, a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """Two batches' statistics (each already over the ranks) as one."""
    out = dict(a)
    for k, v in b.items():
        out[k] = kind_of(kinds, k).of([out[k], v]) if k in out else v
    return out


def spread(
    stats: Mapping[str, torch.Tensor | float], kinds: Kinds, rank: int, world: int
) -> list[torch.Tensor | float]:
    """What this rank adds to the all-reduce sum, in the order of `stats`: a sum as it is, a MIN or
    MAX statistic at this rank's place among `world` entries (0.0 at the others)."""
    out: list[torch.Tensor | float] = []
    for k, v in stats.items():
        if kind_of(kinds, k) is Reduction.SUM:
            out.append(v)
        else:
            out.extend(v if r == rank else 0.0 for r in range(world))
    return out


def gathered(keys: Iterable[str], summed: list[float], kinds: Kinds, world: int) -> dict[str, float]:
    """The all-reduced entries of `spread` back to one value per statistic."""
    out, at = {}, 0
    for k in keys:
        kind = kind_of(kinds, k)
        n = 1 if kind is Reduction.SUM else world
        out[k] = kind.of(summed[at : at + n])
        at += n
    assert at == len(summed), "spread and gathered disagree"
    return out
