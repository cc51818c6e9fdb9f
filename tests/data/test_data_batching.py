"""Sampling (global batch of step s) and collation into MicroBatches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from horizon_cli.data import IGNORE, Row, TokenSet, batch_indices, batch_rows, collate, pad_id_of
from horizon_cli.data.tokset import RowBuilder


def toy_set(lengths, packed_docs=None) -> TokenSet:
    """Rows whose tokens are 1..L+... distinct values; labels = tokens with the first masked."""
    b = RowBuilder()
    nxt = 1
    for i, n in enumerate(lengths):
        ids = np.arange(nxt, nxt + n, dtype=np.int32)
        nxt += n
        labels = ids.copy()
        labels[0] = IGNORE
        docs = None if packed_docs is None else np.asarray(packed_docs[i], np.int32)
        b.add(ids, labels, docs)
    return b.build("tokens", {})


# ---- sampler


def test_no_shuffle_is_file_order_with_wrap_around():
    n, bs = 10, 4
    assert batch_indices(n, 0, bs, 0, False).tolist() == [0, 1, 2, 3]
    assert batch_indices(n, 1, bs, 0, False).tolist() == [4, 5, 6, 7]
    assert batch_indices(n, 2, bs, 0, False).tolist() == [8, 9, 0, 1]  # wraps into epoch 2
    assert batch_indices(n, 3, bs, 0, False).tolist() == [2, 3, 4, 5]
    assert batch_indices(3, 0, 7, 0, False).tolist() == [0, 1, 2, 0, 1, 2, 0]  # batch larger than the set


def test_shuffle_is_a_fresh_permutation_per_epoch():
    n, bs, seed = 12, 4, 7
    stream = np.concatenate([batch_indices(n, s, bs, seed, True) for s in range(9)])  # 3 epochs
    epochs = stream.reshape(3, n)
    for e in epochs:
        assert sorted(e.tolist()) == list(range(n))
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[0], np.arange(n))


def test_shuffle_batches_spanning_epochs():
    n, bs, seed = 10, 4, 1
    stream = np.concatenate([batch_indices(n, s, bs, seed, True) for s in range(5)])  # 20 = 2 epochs
    assert sorted(stream[:10].tolist()) == list(range(n))
    assert sorted(stream[10:].tolist()) == list(range(n))


def test_sampler_is_a_pure_function_of_its_arguments():
    a = batch_indices(100, 37, 8, 3, True)
    for s in range(40):  # other calls in between change nothing
        batch_indices(100, s, 8, 3, True)
        batch_indices(100, s, 8, 4, True)
    assert np.array_equal(a, batch_indices(100, 37, 8, 3, True))
    assert not np.array_equal(a, batch_indices(100, 37, 8, 4, True))


def test_batch_rows_returns_the_rows():
    ts = toy_set([2, 3, 4])
    rows = batch_rows(ts, 1, 2, 0, False)  # positions 2, 3 -> rows 2, 0
    assert [r.input_ids.tolist() for r in rows] == [ts[2].input_ids.tolist(), ts[0].input_ids.tolist()]


def test_view_rows_and_stats():
    ts = toy_set([2, 3, 4])
    v = ts.select([2, 0])
    assert len(v) == 2 and v[0].input_ids.tolist() == ts[2].input_ids.tolist()
    assert v.row_lengths.tolist() == [4, 2] and v.num_tokens == 6
    assert v.label_tokens == 3 + 1  # the first label of a row never counts


# ---- collate


def test_collate_pads_right_and_splits_micro_batches():
    ts = toy_set([3, 5, 2, 4, 1])
    rows = ts.rows(range(5))
    mbs = collate(rows, 2, pad_id=0)
    assert [mb.input_ids.shape for mb in mbs] == [(2, 5), (2, 4), (1, 1)]
    first = mbs[0]
    assert first.input_ids.dtype == torch.int64 and first.labels.dtype == torch.int64
    assert first.input_ids[0].tolist() == [*rows[0].input_ids.tolist(), 0, 0]
    assert first.labels[0].tolist() == [*rows[0].labels.tolist(), IGNORE, IGNORE]
    assert first.position_ids.tolist() == [list(range(5))] * 2
    assert first.doc_ids is None
    assert sum(mb.label_tokens for mb in mbs) == ts.label_tokens


def test_collate_matches_micro_batch_from_rows():
    ts = toy_set([3, 5])
    rows = ts.rows([0, 1])
    (mb,) = collate(rows, 4, pad_id=9)
    ref = type(mb).from_rows([(r.input_ids.tolist(), r.labels.tolist()) for r in rows], pad_id=9)
    for name in ("input_ids", "labels", "position_ids"):
        assert torch.equal(getattr(mb, name), getattr(ref, name))


def test_collate_packed_rows():
    ts = toy_set([5, 3], packed_docs=[[0, 0, 1, 1, 1], [0, 1, 2]])
    (mb,) = collate(ts.rows([0, 1]), 2, pad_id=0)
    assert mb.doc_ids.dtype == torch.int32
    assert mb.doc_ids.tolist() == [[0, 0, 1, 1, 1], [0, 1, 2, 3, 3]]  # padding: one more document
    assert mb.position_ids.tolist() == [[0, 1, 0, 1, 2], [0, 0, 0, 0, 1]]
    assert mb.labels[1, 3:].tolist() == [IGNORE, IGNORE]


def test_row_position_ids():
    row = Row(np.zeros(6, np.int32), np.zeros(6, np.int32), np.array([0, 0, 0, 1, 2, 2], np.int32))
    assert row.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert Row(np.zeros(3, np.int32), np.zeros(3, np.int32)).position_ids.tolist() == [0, 1, 2]


class _Tok:
    def __init__(self, pad, eos):
        self.pad_token_id, self.eos_token_id = pad, eos


@pytest.mark.parametrize("pad, eos, want", [(3, 2, 3), (None, 2, 2), (None, None, 0)])
def test_pad_id_falls_back_to_eos_then_zero(pad, eos, want):
    assert pad_id_of(_Tok(pad, eos)) == want
