"""Data stage 3, the token set: every training row as flat numpy arrays.

    tokens   (total,) int32   all rows' input_ids back to back
    labels   (total,) int32   aligned with tokens; IGNORE where no loss
    offsets  (rows + 1,) int64  row r is tokens[offsets[r]:offsets[r + 1]]
    doc_ids  (total,) int32 or None  document index within its row (packed rows only)

`index` optionally maps logical rows to stored rows, so a split (train / eval) is a view that
shares the arrays, which may be read-only memory maps of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np

from .batch import IGNORE


@dataclass
class Row:
    """One training row. input_ids, labels: (L,) int32; doc_ids: (L,) int32 or None; media: the
    processor's image tensors of the row by name, dim 0 per image or patch (vision.imageset)."""

    input_ids: np.ndarray
    labels: np.ndarray
    doc_ids: np.ndarray | None = None
    media: dict[str, np.ndarray] | None = None

    @property
    def position_ids(self) -> np.ndarray:
        """(L,) int64 positions restarting at 0 at each document."""
        return positions(self.doc_ids, len(self.input_ids))


class Rows(Protocol):
    """What the sampler and the loop read of a set of rows (a TokenSet, or mixture.MixedSet)."""

    def __len__(self) -> int: ...
    def rows(self, indices, /) -> list[Row]: ...


class RowTable(Rows, Protocol):
    """Rows with their totals and a selection: a TokenSet or a mixture.MixedSet (what a
    data.pairs.PairSet views pair by pair)."""

    format: str
    stats: dict

    def select(self, indices) -> RowTable: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def label_tokens(self) -> int: ...


@dataclass
class TokenSet:
    tokens: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    doc_ids: np.ndarray | None = None
    format: str = ""
    stats: dict = field(default_factory=dict)  # counters from building (examples, truncated, ...)
    index: np.ndarray | None = None  # logical row -> stored row; None: identity

    def __len__(self) -> int:
        return len(self.offsets) - 1 if self.index is None else len(self.index)

    def __getitem__(self, i: int) -> Row:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        i = i % n
        r = int(i if self.index is None else self.index[i])
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        docs = None if self.doc_ids is None else self.doc_ids[a:b]
        return Row(self.tokens[a:b], self.labels[a:b], docs)

    def rows(self, indices) -> list[Row]:
        return [self[int(i)] for i in indices]

    @property
    def packed(self) -> bool:
        return self.doc_ids is not None

    @property
    def stored_rows(self) -> np.ndarray:
        """(n,) the stored row of each logical row."""
        return np.arange(len(self.offsets) - 1) if self.index is None else self.index

    @property
    def row_lengths(self) -> np.ndarray:
        """(n,) tokens per row."""
        r = self.stored_rows
        return self.offsets[r + 1] - self.offsets[r]

    @cached_property
    def row_label_tokens(self) -> np.ndarray:
        """(n,) tokens that carry loss per row, after the shift by one (a row's first label never does)."""
        has = (np.asarray(self.labels) != IGNORE).astype(np.int64)  # (total,)
        csum = np.concatenate([[0], np.cumsum(has)])  # (total + 1,)
        r = self.stored_rows
        start, end = self.offsets[r], self.offsets[r + 1]
        return csum[end] - csum[start] - has[start]

    @property
    def num_tokens(self) -> int:
        if self.index is None and "tokens" in self.stats:  # a whole set: counted when built
            return int(self.stats["tokens"])
        return int(self.row_lengths.sum())

    @property
    def label_tokens(self) -> int:
        """Tokens that carry loss (after the shift by one) in the whole set."""
        if self.index is None and "label_tokens" in self.stats:  # no pass over a memory-mapped cache
            return int(self.stats["label_tokens"])
        return int(self.row_label_tokens.sum())

    def select(self, rows) -> TokenSet:
        """A view of some logical rows (in the given order) sharing the arrays."""
        rows = np.asarray(rows, dtype=np.int64)
        index = rows if self.index is None else self.index[rows]
        return TokenSet(self.tokens, self.labels, self.offsets, self.doc_ids, self.format, self.stats, index)

    def summary(self) -> str:
        return f"{len(self)} rows, {self.num_tokens} tokens, {self.label_tokens} with loss"


def positions(doc_ids: np.ndarray | None, length: int) -> np.ndarray:
    """(L,) int64 positions, restarting at 0 wherever the document id changes."""
    pos = np.arange(length, dtype=np.int64)
    if doc_ids is None or length == 0:
        return pos
    d = np.asarray(doc_ids)
    starts = np.flatnonzero(np.concatenate([[True], d[1:] != d[:-1]]))  # first token of each doc
    run = np.diff(np.concatenate([starts, [length]]))
    return pos - np.repeat(starts, run)


class RowBuilder:
    """Collects rows (one example each, or packed rows from `pack.Packer`) into a TokenSet."""

    def __init__(self) -> None:
        self._ids: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._docs: list[np.ndarray] = []
        self._lengths: list[int] = []

    def add(self, ids: np.ndarray, labels: np.ndarray, doc_ids: np.ndarray | None = None) -> None:
        self._ids.append(ids)
        self._labels.append(labels)
        if doc_ids is not None:
            self._docs.append(doc_ids)
        self._lengths.append(len(ids))

    def build(self, fmt: str, stats: dict) -> TokenSet:
        def cat(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)

        offsets = np.concatenate([[0], np.cumsum(self._lengths, dtype=np.int64)]).astype(np.int64)
        docs = cat(self._docs) if self._docs else None
        return TokenSet(cat(self._ids), cat(self._labels), offsets, docs, fmt, stats)


class MediaBuilder:
    """Rows' media (the image tensors of vision.imageset), collected beside a RowBuilder's tokens
    (a text-only row holds none)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, np.ndarray]] = []

    def add(self, media: dict[str, np.ndarray]) -> None:
        self.rows.append(media)

    def arrays(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every name's rows back to back, and each row's offsets (rows without it: none)."""
        names = {k for m in self.rows for k in m}
        media, offs = {}, {}
        for k in sorted(names):
            like = next(m[k] for m in self.rows if k in m)
            parts = [m.get(k, np.zeros((0, *like.shape[1:]), like.dtype)) for m in self.rows]
            media[k] = np.concatenate(parts)
            offs[k] = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        return media, offs
