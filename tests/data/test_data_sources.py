"""Data sources: every file type, save_to_disk directories, hub names, unreadable input."""

from __future__ import annotations

import json

import datasets
import huggingface_hub.constants
import pytest

from horizon_cli.config.schema import DataConfig
from horizon_cli.data import prepare_data
from horizon_cli.errors import InputError

TEXTS = ["Hello world", "The quick brown fox", "one two three"]


def prep(path, tokenizer, **cfg):
    return prepare_data(DataConfig(path=str(path), **cfg), tokenizer, log=lambda _: None)


def token_lists(ts) -> list[list[int]]:
    return [ts[i].input_ids.tolist() for i in range(len(ts))]


@pytest.fixture(scope="module")
def expected(tok):
    return [[tok.bos_token_id, *tok(t, add_special_tokens=False).input_ids, tok.eos_token_id] for t in TEXTS]


def write(tmp_path, kind: str):
    """TEXTS as a file (or save_to_disk directory) of the given kind."""
    records = [{"text": t} for t in TEXTS]
    path = tmp_path / f"data.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif kind == "json":
        path.write_text(json.dumps(records))
    elif kind == "txt":
        path.write_text("\n".join(TEXTS) + "\n")
    elif kind == "csv":
        datasets.Dataset.from_list(records).to_csv(str(path), index=False)
    elif kind == "parquet":
        datasets.Dataset.from_list(records).to_parquet(str(path))
    elif kind == "disk":
        datasets.Dataset.from_list(records).save_to_disk(str(path))
    elif kind == "dict":
        other = datasets.Dataset.from_list([{"text": "other split"}])
        datasets.DatasetDict({"train": other, "mine": datasets.Dataset.from_list(records)}).save_to_disk(
            str(path)
        )
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "txt", "csv", "parquet", "disk"])
def test_every_source_kind_gives_the_same_tokens(tmp_path, tok, expected, kind):
    out = prep(write(tmp_path, kind), tok)
    assert out.format == "text"
    assert token_lists(out.train) == expected


def test_dataset_dict_uses_data_split(tmp_path, tok, expected):
    path = write(tmp_path, "dict")
    assert token_lists(prep(path, tok, split="mine").train) == expected
    assert len(prep(path, tok).train) == 1  # split: train
    with pytest.raises(InputError, match="no split 'nope'"):
        prep(path, tok, split="nope")


def test_save_to_disk_is_cached_by_fingerprint(tmp_path, tok, expected):
    path = write(tmp_path, "disk")
    cache = tmp_path / "cache"
    first = prepare_data(DataConfig(path=str(path), cache_dir=str(cache)), tok, log=lambda _: None)
    logs: list[str] = []
    again = prepare_data(DataConfig(path=str(path), cache_dir=str(cache)), tok, log=logs.append)
    assert any("cache hit" in line for line in logs)
    assert token_lists(again.train) == token_lists(first.train) == expected


def test_missing_path_names_it(tmp_path, tok):
    with pytest.raises(InputError, match=r"data.path: .*nope.jsonl: no such file or directory"):
        prep(tmp_path / "nope.jsonl", tok)


def test_eval_path_missing_names_the_key(tmp_path, tok):
    cfg = DataConfig(path=str(write(tmp_path, "jsonl")), eval_path=str(tmp_path / "gone.jsonl"))
    with pytest.raises(InputError, match=r"data.eval_path: .*gone.jsonl: no such file"):
        prepare_data(cfg, tok, log=lambda _: None)


def test_hub_name_offline_is_a_clear_error(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=r"data.path: someone/no-such-dataset: .*offline"):
        prep("someone/no-such-dataset", tok)


def test_unsupported_file_type(tmp_path, tok):
    path = tmp_path / "data.xml"
    path.write_text("<a/>")
    with pytest.raises(InputError, match=r"data.xml: unsupported file type '.xml'"):
        prep(path, tok)


def test_directory_that_is_not_save_to_disk(tmp_path, tok):
    (tmp_path / "dir").mkdir()
    with pytest.raises(InputError, match="not a datasets save_to_disk directory"):
        prep(tmp_path / "dir", tok)


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("bad.jsonl", '{"text": "a"}\n{"text": \n', r"bad.jsonl: cannot read as json: .*JSON parse error"),
        ("bad.parquet", "not parquet", r"bad.parquet: cannot read as parquet"),
        ("empty.jsonl", "", r"empty.jsonl: the dataset is empty"),
        ("empty.json", "[]", r"empty.json: the dataset is empty"),
        ("blank.txt", "\n  \n\n", r"blank.txt: the dataset is empty: all 3 records are blank"),
    ],
)
def test_unreadable_or_empty_files(tmp_path, tok, name, content, match):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(InputError, match=match):
        prep(path, tok)
