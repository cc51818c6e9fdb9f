"""Data stage 3d, the mixture: several sources' token sets -> the rows of one epoch.

A source's weight w is how many times each of its rows is in an epoch: w = 2 puts every row in
twice, w = 0.5 a seeded half of them (the same half every epoch), w = 1.5 every row once and a
seeded half again. The sampler then draws from the mixed rows as from one set (a seeded
permutation per epoch with `shuffle`), so the mixture holds every step on average and every
epoch exactly. Documents of different sources never share a row (each source is packed alone).

`MixedSet` is a view: row i is row rows[i] of set parts[part[i]], and the parts stay what they
were (memory maps of the cache), so mixing copies no tokens. Preference sources (data.pairs
PairSets) are mixed pair by pair: the weights count pairs, and the mixture is a PairSet again.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..errors import InputError
from .pairs import PairSet
from .tokset import Row, TokenSet


class MixedSet:
    """Rows of several token sets as one (what the sampler, the loop and the eval read)."""

    def __init__(self, parts: list[TokenSet], part: np.ndarray, rows: np.ndarray, fmt: str, stats: dict):
        self.parts, self.part, self.row = parts, part, rows  # (n,) int64 each
        self.format, self.stats = fmt, stats

    def __len__(self) -> int:
        return len(self.row)

    def __getitem__(self, i: int) -> Row:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        i %= n
        return self.parts[int(self.part[i])][int(self.row[i])]

    def rows(self, indices) -> list[Row]:
        return [self[int(i)] for i in indices]

    @property
    def packed(self) -> bool:
        return any(p.packed for p in self.parts)

    def _per_row(self, values: list[np.ndarray]) -> np.ndarray:
        out = np.zeros(len(self), dtype=np.int64)
        for k, v in enumerate(values):
            sel = self.part == k
            out[sel] = np.asarray(v)[self.row[sel]]
        return out

    @property
    def row_lengths(self) -> np.ndarray:
        return self._per_row([p.row_lengths for p in self.parts])

    @property
    def row_label_tokens(self) -> np.ndarray:
        return self._per_row([p.row_label_tokens for p in self.parts])

    @property
    def num_tokens(self) -> int:
        return int(self.row_lengths.sum())

    @property
    def label_tokens(self) -> int:
        return int(self.row_label_tokens.sum())

    def select(self, rows) -> MixedSet:
        rows = np.asarray(rows, dtype=np.int64)
        return MixedSet(self.parts, self.part[rows], self.row[rows], self.format, self.stats)

    def summary(self) -> str:
        return f"{len(self)} rows, {self.num_tokens} tokens, {self.label_tokens} with loss"


def mix(
    parts: list,
    weights: list[float],
    labels: list[str],
    seed: int,
    log: Callable[[str], None] | None,
):
    """The epoch's rows: each part's rows `weight` times (see the module doc). One part of weight
    1 is returned as it is. Parts that are all PairSets are mixed by whole pairs (a PairSet)."""
    if len(parts) == 1 and weights[0] == 1.0:
        return parts[0]
    pairs = all(isinstance(p, PairSet) for p in parts)  # data.prepare never mixes pairs and rows
    unit, one = ("pairs", "pair") if pairs else ("rows", "row")
    part_ids, row_ids, counts = [], [], []
    for k, (ts, w) in enumerate(zip(parts, weights, strict=True)):
        items = repeat_rows(len(ts), w, np.random.default_rng([seed, k, 0x313C]))
        if len(items) == 0:
            raise InputError(
                f"{labels[k]}: weight {w:g} of its {len(ts)} {unit} is no {one} at all; raise its weight"
            )
        rows = ts.row_ids(items) if pairs else items  # a pair: its chosen and rejected rows
        part_ids.append(np.full(len(rows), k, dtype=np.int64))
        row_ids.append(rows)
        counts.append(len(items))
    formats = sorted({p.format for p in parts})
    fmt = formats[0] if len(formats) == 1 else "+".join(formats)
    sets = [p.ts for p in parts] if pairs else parts
    mixed = MixedSet(sets, np.concatenate(part_ids), np.concatenate(row_ids), fmt, {"sources": len(parts)})
    if log is not None:
        total = sum(counts)
        shares = ", ".join(
            f"{label} {len(ts)} {unit}" + (f" x {w:g}" if w != 1 else "") + f" = {c} ({100 * c / total:.1f}%)"
            for label, ts, w, c in zip(labels, parts, weights, counts, strict=True)
        )
        log(f"data: mixture per epoch: {shares}")
    return PairSet(mixed) if pairs else mixed


def repeat_rows(n: int, weight: float, rng: np.random.Generator) -> np.ndarray:
    """(round(n * weight),) int64 row indices: every row floor(weight) times, then a seeded
    subset of the fraction, in row order."""
    whole = math.floor(weight)
    extra = round((weight - whole) * n)
    picked = np.sort(rng.choice(n, size=extra, replace=False)) if extra else np.zeros(0, np.int64)
    return np.concatenate([np.tile(np.arange(n, dtype=np.int64), whole), picked.astype(np.int64)])


def concat(parts: list):
    """Several eval sets as one (no weights), or None when there are none."""
    if not parts:
        return None
    return mix(parts, [1.0] * len(parts), [""] * len(parts), 0, None)
