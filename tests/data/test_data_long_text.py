"""`text` documents longer than a row continue in the next rows, packed or not: nothing is cut,
and every token but a document's first is predicted exactly once (horizon_cli/data/pack.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from horizon_cli.config.schema import DataConfig
from horizon_cli.data import IGNORE, prepare_data

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def prep(tmp_path, texts, tok, logs=None, **cfg):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    log = logs.append if logs is not None else (lambda _: None)
    return prepare_data(DataConfig(path=str(path), shuffle=False, **cfg), tok, log=log).train


def full_ids(tok, text) -> list[int]:
    return [tok.bos_token_id, *tok(text, add_special_tokens=False).input_ids, tok.eos_token_id]


def long_text(n_words: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), n_words))


def documents(train) -> list[list[tuple[list[int], list[int]]]]:
    """Each document's pieces, in row order: (ids, labels) per piece (packed rows split by doc_ids;
    a piece that ends a row continues in the next row's first document)."""
    pieces = []
    for i in range(len(train)):
        row = train[i]
        docs = row.doc_ids if row.doc_ids is not None else np.zeros(len(row.input_ids), np.int32)
        for d in np.unique(docs):
            sel = docs == d
            pieces.append((row.input_ids[sel].tolist(), row.labels[sel].tolist()))
    return pieces


def rejoin(pieces) -> list[int]:
    """Consecutive pieces overlap by one token."""
    out = list(pieces[0][0])
    for ids, _ in pieces[1:]:
        assert ids[0] == out[-1]
        out += ids[1:]
    return out


def predicted(pieces) -> int:
    """Tokens predicted: every label after a piece's first (the shift by one)."""
    return sum(sum(label != IGNORE for label in labels[1:]) for _, labels in pieces)


@pytest.mark.parametrize("packing", [False, True])
def test_a_long_document_is_never_cut(tmp_path, tok, packing):
    text = long_text(700)  # the case: a record many rows long kept only its first row
    want = full_ids(tok, text)
    assert len(want) > 10 * 64
    logs: list[str] = []
    train = prep(tmp_path, [text], tok, logs, max_seq_len=64, packing=packing)
    assert all(len(train[i].input_ids) <= 64 for i in range(len(train)))
    assert all(len(train[i].input_ids) == 64 for i in range(len(train) - 1))  # full rows
    pieces = documents(train)
    assert rejoin(pieces) == want
    assert predicted(pieces) == len(want) - 1 == train.label_tokens  # each token once, none lost
    assert train.stats["truncated"] == 0 and train.stats["split"] == 1
    assert any("1 documents longer than max_seq_len 64 continue over consecutive rows" in x for x in logs)


def test_packed_long_document_fills_the_row_it_starts_in(tmp_path, tok):
    short, text = "one two", long_text(300)
    train = prep(tmp_path, [short, text, short], tok, max_seq_len=64, packing=True)
    s, long_ids = full_ids(tok, short), full_ids(tok, text)
    first = train[0]
    assert len(first.input_ids) == 64  # the short document, then the long one's head
    assert first.input_ids[: len(s)].tolist() == s
    assert first.input_ids[len(s) :].tolist() == long_ids[: 64 - len(s)]
    pieces = documents(train)
    assert pieces[0][0] == s and pieces[-1][0] == s
    assert rejoin(pieces[1:-1]) == long_ids
    assert train.label_tokens == 2 * (len(s) - 1) + len(long_ids) - 1
    # no token predicts across a document boundary: each document's first label is IGNORE
    assert all(labels[0] == IGNORE for _, labels in pieces)


def test_split_at_the_exact_boundaries(tmp_path, tok):
    """A document of exactly max_seq_len is one row; one token more gives a second row of two
    tokens (the overlap and the last token), which still predicts that last token."""
    text = long_text(30, seed=1)
    n = len(full_ids(tok, text))
    for max_len, lengths in ((n, [n]), (n - 1, [n - 1, 2])):
        train = prep(tmp_path, [text], tok, max_seq_len=max_len)
        assert [len(train[i].input_ids) for i in range(len(train))] == lengths
        assert train.label_tokens == n - 1
    with_room = prep(tmp_path, [long_text(40, seed=2)], tok, max_seq_len=16, packing=True)
    assert documents(with_room)[0][0][0] == tok.bos_token_id


def test_chat_records_are_still_truncated_and_counted(tmp_path, tok):
    """Only `text` continues: a chat record cut in the middle would lose its turn structure."""
    path = tmp_path / "c.jsonl"
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": long_text(80)}]}
    path.write_text(json.dumps(rec) + "\n")
    out = prepare_data(DataConfig(path=str(path), max_seq_len=32), tok, log=lambda _: None).train
    assert len(out) == 1 and len(out[0].input_ids) == 32
    assert out.stats["truncated"] == 1 and out.stats["cut_tokens"] > 0 and out.stats["split"] == 0
