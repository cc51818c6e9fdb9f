"""Data stage 4, sampling: which rows make up the global batch of step s.

A pure function of (seed, step, dataset size N, batch_size, shuffle), with no iterator state,
so resuming at step s needs only s. Position k = s * batch_size + j (j < batch_size) of the
endless stream is row k % N of epoch k // N: in file order without shuffle (so each step takes
the next batch_size rows, wrapping around at the end of an epoch), or through a fresh seeded
permutation of the N rows per epoch with shuffle.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .tokset import Row, Rows


def batch_indices(n: int, step: int, batch_size: int, seed: int, shuffle: bool) -> np.ndarray:
    """(batch_size,) int64 row indices of step `step`'s global batch."""
    if n <= 0:
        raise ValueError("cannot sample from an empty token set")
    k = step * batch_size + np.arange(batch_size, dtype=np.int64)  # stream positions
    epoch, pos = k // n, k % n
    if not shuffle:
        return pos
    out = np.empty_like(pos)
    for e in np.unique(epoch):  # a batch spans at most a few epochs
        sel = epoch == e
        out[sel] = epoch_permutation(n, int(e), seed)[pos[sel]]
    return out


@lru_cache(maxsize=4)
def epoch_permutation(n: int, epoch: int, seed: int) -> np.ndarray:
    """(n,) the row order of one epoch: seeded by (seed, epoch) only."""
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    perm.flags.writeable = False  # shared through the cache
    return perm


def batch_rows(tokset: Rows, step: int, batch_size: int, seed: int, shuffle: bool) -> list[Row]:
    """The rows of step `step`'s global batch."""
    return tokset.rows(batch_indices(len(tokset), step, batch_size, seed, shuffle))
