"""The data pipeline at its exact boundaries, where an off-by-one hides from random data.

Pre-tokenized records (format `tokens`) give examples of exact lengths and labels:
  * packing: documents that fill a row exactly share it (a row holds up to max_seq_len tokens);
  * truncation: an example of exactly max_seq_len tokens is whole, not "truncated";
  * loss after the shift: an example whose only label is on its first token has nothing to
    predict (position t predicts token t + 1) and is dropped as having no loss tokens.
"""

from __future__ import annotations

import json

from horizon_cli.config.schema import DataConfig
from horizon_cli.data import IGNORE, prepare_data

MAX = 16


def prep(tmp_path, records: list[dict], **cfg):
    path = tmp_path / "tokens.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    logs: list[str] = []
    data = DataConfig(path=str(path), format="tokens", max_seq_len=MAX, shuffle=False, **cfg)
    out = prepare_data(data, None, vocab_size=100, log=logs.append)
    return out.train, logs


def ids(n: int, start: int = 1) -> dict:
    return {"input_ids": list(range(start, start + n))}


def test_documents_that_fill_a_row_exactly_share_it(tmp_path):
    train, _ = prep(tmp_path, [ids(10), ids(6, 20), ids(16, 40), ids(3, 70)], packing=True)
    assert [len(train[i].input_ids) for i in range(len(train))] == [16, 16, 3]
    assert train[0].doc_ids.tolist() == [0] * 10 + [1] * 6
    assert train[0].input_ids.tolist() == list(range(1, 11)) + list(range(20, 26))


def test_an_example_of_exactly_max_seq_len_is_not_truncated(tmp_path):
    train, logs = prep(tmp_path, [ids(MAX), ids(MAX + 1, 30)])
    assert [len(train[i].input_ids) for i in range(len(train))] == [MAX, MAX]
    assert train.stats["truncated"] == 1
    assert any("1 truncated to max_seq_len 16" in line for line in logs), logs


def test_an_example_with_loss_only_on_its_first_token_has_nothing_to_predict(tmp_path):
    first_only = {"input_ids": [5, 6, 7, 8], "labels": [5, IGNORE, IGNORE, IGNORE]}
    last_only = {"input_ids": [5, 6, 7, 8], "labels": [IGNORE, IGNORE, IGNORE, 8]}
    train, _ = prep(tmp_path, [first_only, last_only])
    assert len(train) == 1 and train.stats["no_labels"] == 1
    assert train[0].labels.tolist() == last_only["labels"]
    assert train.label_tokens == 1
