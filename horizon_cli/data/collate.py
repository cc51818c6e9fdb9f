"""Data stage 5, collation: a global batch of rows -> MicroBatch tensors for the engine.

Each micro-batch of up to `micro_batch_size` rows is right-padded to its own longest row:
input_ids with `pad_id`, labels with IGNORE. Packed rows also get doc_ids; the padding run
counts as one more document of its row (id = number of real documents) with positions from 0,
so doc_ids stay non-negative and non-decreasing along a row.
"""

from __future__ import annotations

import numpy as np
import torch

from .batch import IGNORE, MicroBatch
from .tokset import Row, positions


def pad_id_of(tokenizer, vocab_size: int | None = None) -> int:
    """The tokenizer's pad id, else its EOS id, else 0; one inside the model's vocabulary (padding
    is never attended to, so any id will do, but the embedding must be able to look it up)."""
    for tid in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if tid is not None and (vocab_size is None or 0 <= tid < vocab_size):
            return int(tid)
    return 0


def collate(rows: list[Row], micro_batch_size: int, pad_id: int) -> list[MicroBatch]:
    """Rows -> ceil(len(rows) / micro_batch_size) micro-batches, in order."""
    return [_micro(rows[i : i + micro_batch_size], pad_id) for i in range(0, len(rows), micro_batch_size)]


def _micro(rows: list[Row], pad_id: int) -> MicroBatch:
    b, T = len(rows), max(len(r.input_ids) for r in rows)
    ids = np.full((b, T), pad_id, dtype=np.int64)  # (b, T)
    labels = np.full((b, T), IGNORE, dtype=np.int64)  # (b, T)
    for i, r in enumerate(rows):
        ids[i, : len(r.input_ids)] = r.input_ids
        labels[i, : len(r.labels)] = r.labels
    mb = MicroBatch(
        torch.from_numpy(ids),
        torch.from_numpy(labels),
        torch.arange(T).expand(b, T).contiguous(),
        lengths=torch.tensor([len(r.input_ids) for r in rows], dtype=torch.int64),
    )
    if any(r.doc_ids is not None for r in rows):
        docs = np.stack([_padded_docs(r, T) for r in rows])  # (b, T) int32
        pos = np.stack([positions(d, T) for d in docs])  # (b, T) int64
        mb.doc_ids, mb.position_ids = torch.from_numpy(docs), torch.from_numpy(pos)
    if any(r.media for r in rows):  # images: the rows' tensors back to back, as the processor batches them
        names = next(r.media for r in rows if r.media)
        mb.media = {k: torch.from_numpy(np.concatenate([r.media[k] for r in rows if r.media])) for k in names}
    return mb


def _padded_docs(r: Row, T: int) -> np.ndarray:
    """(T,) int32 doc ids of a row; the padding is one extra document."""
    L = len(r.input_ids)
    real = np.zeros(L, np.int32) if r.doc_ids is None else np.asarray(r.doc_ids, np.int32)
    n_docs = int(real[-1]) + 1 if L else 0
    return np.concatenate([real, np.full(T - L, n_docs, np.int32)])
