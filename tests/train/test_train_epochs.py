"""`train.epochs` instead of `train.steps` (exactly one), resolved once from the data; the notes
on a global batch larger than the data and a warmup as long as the run."""

from __future__ import annotations

import json

import pytest
import yaml

from horizon_cli.config import load_config
from horizon_cli.config.schema import DataConfig
from horizon_cli.data import prepare_data
from horizon_cli.errors import ConfigError
from horizon_cli.train.length import warmup_note
from tests.conftest import chat_rows, write_config, write_jsonl
from tests.train.test_train_cli import horizon, one_error_line

BASE = ["model.path=m", "output.dir=o", "data.path=d.jsonl"]


def test_steps_or_epochs_exactly_one():
    assert load_config(None, BASE).train.steps == 1000  # neither: the default steps
    cfg = load_config(None, [*BASE, "train.epochs=2"])
    assert cfg.train.epochs == 2.0 and cfg.train.steps is None  # resolved from the data
    with pytest.raises(ConfigError, match="train.epochs: give train.steps or train.epochs, not both"):
        load_config(None, [*BASE, "train.epochs=2", "train.steps=10"])
    with pytest.raises(ConfigError, match="train.epochs: 0.0 must be greater than 0.0"):
        load_config(None, [*BASE, "train.epochs=0"])
    with pytest.raises(ConfigError, match="train.steps: required"):
        load_config(None, [*BASE, "train.steps=null"])
    assert load_config(None, [*BASE, "train.steps=null", "train.epochs=1.5"]).train.epochs == 1.5


def test_steps_for_epochs_and_the_summary(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(10))
    logs: list[str] = []
    data = prepare_data(DataConfig(path=str(path)), tok, batch_size=4, log=logs.append)
    assert [data.steps_for(e, 4) for e in (1, 2, 0.1, 3)] == [3, 5, 1, 8]  # ceil(epochs x 10 / 4)
    assert any("an epoch is 10 rows = 2.5 steps of train.batch_size 4" in x for x in logs)
    assert not any("note:" in x for x in logs)
    logs.clear()
    prepare_data(DataConfig(path=str(path)), tok, batch_size=16, log=logs.append)
    assert any(
        "data: note: the global batch (train.batch_size 16) is larger than the training set (10 rows)" in x
        for x in logs
    )


def test_warmup_as_long_as_the_run_is_noted():
    cfg = load_config(None, [*BASE, "train.steps=5", "schedule.warmup_steps=5", "optim.lr=1e-3"])
    note = warmup_note(cfg)
    assert note is not None and "warmup_steps 5 is not shorter than the run (train.steps 5)" in note
    assert "never reaches optim.lr 0.001 (the last step uses 0.000833)" in note
    assert warmup_note(load_config(None, [*BASE, "train.steps=6", "schedule.warmup_steps=5"])) is None


def test_a_run_of_epochs_trains_that_many_passes_and_resumes_as_steps(tiny_store, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(10))
    cfg = write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run",
                       train={"steps": None, "epochs": 2, "batch_size": 4, "micro_batch_size": 2},
                       schedule={"warmup_steps": 8})  # fmt: skip
    r = horizon("train", cfg)
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "train.epochs 2 of 10 rows at train.batch_size 4 = train.steps 5" in out
    assert "note: schedule.warmup_steps 8 is not shorter than the run (train.steps 5)" in out
    assert "an epoch is 10 rows = 2.5 steps of train.batch_size 4" in out
    run = tmp_path / "run"
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    saved = yaml.safe_load((run / "config.yaml").read_text())["train"]
    assert (saved["steps"], saved["epochs"]) == (5, 2.0)
    again = horizon("train", cfg)  # the same epochs resolve to the same steps: nothing to do
    assert again.exit_code == 0 and "complete at step 5 (train.steps 5)" in " ".join(again.output.split())
    both = horizon("train", cfg, "train.steps=7")
    assert "train.epochs: give train.steps or train.epochs, not both" in one_error_line(both)


def test_dry_run_shows_the_resolved_steps_and_writes_nothing(tiny_store, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(10))
    cfg = write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run",
                       train={"steps": None, "epochs": 1, "batch_size": 4, "micro_batch_size": 2})  # fmt: skip
    r = horizon("train", cfg, "--dry-run")
    assert r.exit_code == 0, r.output
    assert "steps: 3" in r.output and "epochs: 1.0" in r.output
    assert not (tmp_path / "run").exists()
