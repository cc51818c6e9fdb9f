"""Data stage 3b, packing: examples -> rows of at most max_seq_len tokens holding several documents.

Greedy in dataset order: an example joins the current row if it fits, else it starts the next
row (examples are already truncated to max_seq_len, so each fits in an empty row). Per row,
`doc_ids` number the documents 0, 1, ...; positions restart at 0 per document (derived from
doc_ids); each document's first label is IGNORE, so no token predicts across a boundary. The
engine keeps attention inside a document with doc_ids.
"""

from __future__ import annotations

import numpy as np

from .batch import IGNORE
from .tokset import RowBuilder


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

    def flush(self) -> None:
        if not self._ids:
            return
        docs = np.repeat(np.arange(len(self._ids), dtype=np.int32), [len(x) for x in self._ids])  # (L,)
        self.out.add(np.concatenate(self._ids), np.concatenate(self._labels), docs)
        self._ids, self._labels, self._used = [], [], 0
