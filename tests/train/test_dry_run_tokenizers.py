"""Data that needs a tokenizer, on a model without tokenizer files, in every method: a store
without them is one line naming the store and the format (SFT, DPO, KTO, GRPO alike); a hub id's
dry run, which fetches config.json alone, notes the data is not tokenized and plans the rest."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import chat_rows, horizon, write_jsonl

KTO = [{"prompt": f"question {i}", "completion": f"answer {i}", "label": i % 2 == 0} for i in range(8)]
DPO = [{"prompt": f"question {i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(8)]
GRPO = [{"prompt": f"question {i}"} for i in range(8)]
METHODS = {
    "sft": (chat_rows(8), {}),
    "dpo": (DPO, {"preference": {"loss": "dpo"}}),
    "kto": (KTO, {"preference": {"loss": "kto"}}),
    "grpo": (GRPO, {"rl": {"num_generations": 2, "max_completion_length": 8,
                           "rewards": [{"function": "length", "target": 4}]}}),
}  # fmt: skip
FORMAT = {"sft": "chat", "dpo": "preference", "kto": "unpaired", "grpo": "prompt"}


def _config(tmp: Path, model: str | Path, method: str) -> Path:
    rows, sections = METHODS[method]
    data = write_jsonl(tmp / f"{method}.jsonl", rows)
    cfg = {
        "model": {"path": str(model)},
        "data": {"path": str(data), "max_seq_len": 64},
        "train": {"steps": 2, "batch_size": 2, "micro_batch_size": 1},
        "engine": {"device": "cpu", "dtype": "float32"},
        "output": {"dir": str(tmp / "run")},
        **sections,
    }
    path = tmp / f"{method}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def bare_store(tiny_store, tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("bare") / "store"
    shutil.copytree(tiny_store, store)
    for f in (store / "hf").iterdir():
        if f.name != "config.json":
            f.unlink()
    return store


@pytest.mark.parametrize("method", list(METHODS))
def test_a_store_without_tokenizer_files_is_one_line_in_every_method(bare_store, tmp_path, method):
    r = horizon("train", _config(tmp_path, bare_store, method), "--dry-run")
    lines = r.output.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    assert f"model.path: store {bare_store} has no tokenizer files" in errors[0]
    assert f"format {FORMAT[method]!r} needs a tokenizer" in errors[0]
    assert "Traceback" not in r.output and not (tmp_path / "run").exists()


@pytest.mark.parametrize("method", list(METHODS))
def test_a_hub_ids_dry_run_without_its_tokenizer_notes_it_in_every_method(
    tiny_store, tmp_path, monkeypatch, method
):
    """The cache holds owner/half's config.json alone (what a dry run fetches online)."""
    snap = tmp_path / "cache" / "models--owner--half" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    shutil.copy(tiny_store / "hf" / "config.json", snap / "config.json")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = horizon(
        "train", _config(tmp_path, "owner/half", method), "--dry-run", "--host-gib", 64, "--device-gib", 24
    )
    assert r.exit_code == 0, r.output
    assert "not tokenized (owner/half: a dry run fetches its config.json alone" in r.output
    assert not (tmp_path / "run").exists()
