"""Preference pairs through the data pipeline's sources: several preference sources mixed by whole
pairs (weights count pairs), pairs and SFT rows never in one run, eval pairs from a split,
train.epochs counting pairs, and LLaMA-Factory's `ranking: true` registry entries read as the
pairs they stand for (sharegpt tags rewriting chosen and rejected too)."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest

from horizon_cli.config.schema import DataConfig, SourceConfig
from horizon_cli.data import prepare_data
from horizon_cli.data.pairs import PairSet
from horizon_cli.errors import InputError
from tests.conftest import chat_rows

A = [{"prompt": f"Say {w}.", "chosen": f" {w}!", "rejected": f" not {w}."} for w in ("one", "two", "three")]
B = [{"prompt": f"Name {w}.", "chosen": f" {w}.", "rejected": " no."} for w in ("red", "blue")]


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prep(tok, logs=None, batch_size=None, **cfg):
    log = logs.append if logs is not None else (lambda _: None)
    return prepare_data(
        DataConfig(**{"max_seq_len": 128, "shuffle": False, **cfg}), tok, log=log, batch_size=batch_size
    )


def pairs_of(ps: PairSet) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each pair as (chosen ids, rejected ids): its two rows, in order."""
    rows = ps.rows(np.arange(len(ps)))
    return [
        (tuple(c.input_ids.tolist()), tuple(r.input_ids.tolist()))
        for c, r in zip(rows[::2], rows[1::2], strict=True)
    ]


def test_preference_sources_mix_by_whole_pairs(tmp_path, tok):
    a, b = jsonl(tmp_path / "a.jsonl", A), jsonl(tmp_path / "b.jsonl", B)
    one_a, one_b = pairs_of(prep(tok, path=str(a)).train), pairs_of(prep(tok, path=str(b)).train)
    logs: list[str] = []
    out = prep(
        tok, logs, batch_size=4, path=[SourceConfig(path=str(a)), SourceConfig(path=str(b), weight=2.0)]
    )
    assert isinstance(out.train, PairSet) and out.format == "preference" and out.unit == "pairs"
    assert len(out.train) == 3 + 2 * 2
    assert pairs_of(out.train) == one_a + one_b + one_b  # every pair whole: its chosen row, then its rejected
    assert any(
        "mixture per epoch: " in x and "a.jsonl 3 pairs = 3" in x and "b.jsonl 2 pairs x 2 = 4" in x
        for x in logs
    )
    assert any("an epoch is 7 pairs = 1.75 steps of train.batch_size 4" in x for x in logs)
    assert out.steps_for(2, 4) == 4  # train.epochs 2 of 7 pairs at batch 4: ceil(3.5)
    half = prep(tok, path=[SourceConfig(path=str(a), weight=0.5), SourceConfig(path=str(b))])
    assert len(half.train) == 2 + 2 and set(pairs_of(half.train)[:2]) <= set(one_a)
    split = prep(tok, path=[SourceConfig(path=str(a)), SourceConfig(path=str(b))], eval_fraction=0.34)
    assert isinstance(split.eval, PairSet) and len(split.train) + len(split.eval) == 5
    assert set(pairs_of(split.train)).isdisjoint(pairs_of(split.eval))


def test_pairs_and_sft_rows_are_never_one_run(tmp_path, tok):
    a, chat = jsonl(tmp_path / "a.jsonl", A), jsonl(tmp_path / "chat.jsonl", chat_rows(3))
    with pytest.raises(
        InputError, match=r"chat.jsonl is format chat, and other sources hold preference pairs"
    ):
        prep(tok, path=[SourceConfig(path=str(a)), SourceConfig(path=str(chat))])


def test_eval_split_holds_pairs(tmp_path, tok):
    d = tmp_path / "dd"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(A),
        "test": datasets.Dataset.from_list(B),
    }).save_to_disk(str(d))  # fmt: skip
    logs: list[str] = []
    out = prep(tok, logs, path=str(d), eval_split="test")
    assert isinstance(out.eval, PairSet) and len(out.train) == 3 and len(out.eval) == 2
    assert pairs_of(out.eval) == pairs_of(prep(tok, path=str(d), split="test").train)
    assert any("data: eval (split 'test'): 2 pairs (4 sequences)" in x for x in logs)


def test_llamafactory_ranking_entries_are_pairs(tmp_path, tok):
    alpaca = [{"q": "Say one.", "good": "one!", "bad": "not one."}]
    jsonl(tmp_path / "al.jsonl", alpaca)
    plain = jsonl(
        tmp_path / "plain.jsonl",
        [{"instruction": "Say one.", "input": "", "chosen": "one!", "rejected": "not one."}],
    )
    sg = [
        {
            "dialog": [{"who": "me", "says": "hi"}],
            "good": {"who": "bot", "says": "Hello!"},
            "bad": {"who": "bot", "says": "Go away."},
        }
    ]
    jsonl(tmp_path / "sg.jsonl", sg)
    twin = jsonl(
        tmp_path / "twin.jsonl",
        [
            {
                "conversations": [{"from": "human", "value": "hi"}],
                "chosen": {"from": "gpt", "value": "Hello!"},
                "rejected": {"from": "gpt", "value": "Go away."},
            }
        ],
    )
    tags = {"role_tag": "who", "content_tag": "says", "user_tag": "me", "assistant_tag": "bot"}
    reg = tmp_path / "dataset_info.json"
    reg.write_text(json.dumps({
        "al": {"file_name": "al.jsonl", "ranking": True, "columns": {"prompt": "q", "chosen": "good", "rejected": "bad"}},
        "sg": {"file_name": "sg.jsonl", "ranking": True, "formatting": "sharegpt", "tags": tags,
               "columns": {"messages": "dialog", "chosen": "good", "rejected": "bad"}},
    }))  # fmt: skip
    out = prep(tok, path=str(reg))
    assert isinstance(out.train, PairSet) and out.format == "preference" and len(out.train) == 2
    assert pairs_of(out.train) == pairs_of(prep(tok, path=str(plain)).train) + pairs_of(
        prep(tok, path=str(twin)).train
    )
