"""Data stage 3b, rows: examples -> rows of at most max_seq_len tokens.

Packing is greedy in dataset order: an example joins the current row if it fits, else it starts
the next row. Per row, `doc_ids` number the documents 0, 1, ...; positions restart at 0 per
document (derived from doc_ids); each document's first label is IGNORE, so no token predicts
across a boundary. The engine keeps attention inside a document with doc_ids.

A `text` document longer than a row is never cut: it continues in the next rows (`pieces`;
packed, it first fills what is left of the current row). Consecutive pieces overlap by one token,
so that every token of the document but its first is predicted exactly once: a row's first token
is only context (its label is never used: labels are shifted by one), and it is the token the
previous piece ended with. Other formats are truncated to a row (prepare.py counts what is cut).
"""

from __future__ import annotations

import numpy as np

from .batch import IGNORE
from .tokset import RowBuilder

MIN_PIECE = 2  # a piece of one token predicts nothing


def pieces(
    ids: np.ndarray, labels: np.ndarray, first: int, max_len: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(L,) ids and labels -> consecutive pieces, the first of at most `first` tokens, the others
    of at most max_len, each starting with the last token of the one before."""
    out, start, room = [], 0, first
    while len(ids) - start > room:
        out.append((ids[start : start + room], labels[start : start + room]))
        start += room - 1  # the overlap: this piece's last token opens the next
        room = max_len
    out.append((ids[start:], labels[start:]))
    return out


class Packer:
    """Feeds packed rows into a RowBuilder; call `flush()` after the last example."""

    def __init__(self, max_len: int, out: RowBuilder) -> None:
        self.max_len = max_len
        self.out = out
        self._ids: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._used = 0

    def add(self, ids: np.ndarray, labels: np.ndarray) -> None:
        if self._used + len(ids) > self.max_len:
            self.flush()
        labels = labels.copy()
        labels[0] = IGNORE  # the previous document's last token must not predict this one
        self._ids.append(ids)
        self._labels.append(labels)
        self._used += len(ids)

    def add_long(self, ids: np.ndarray, labels: np.ndarray) -> int:
        """A document that may be longer than a row: its pieces, the first in what is left of the
        current row. Returns the number of pieces."""
        room = self.max_len - self._used
        if room < MIN_PIECE or (len(ids) <= self.max_len and len(ids) > room):
            room = self.max_len  # a short document is not split to fill a row: it starts the next
        parts = pieces(ids, labels, room, self.max_len)
        for piece in parts:
            self.add(*piece)
        return len(parts)

    def flush(self) -> None:
        if not self._ids:
            return
        docs = np.repeat(np.arange(len(self._ids), dtype=np.int32), [len(x) for x in self._ids])  # (L,)
        self.out.add(np.concatenate(self._ids), np.concatenate(self._labels), docs)
        self._ids, self._labels, self._used = [], [], 0
