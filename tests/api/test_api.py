"""The Python API (horizon_cli/api.py): each command as a function with a result object, a config
given as a mapping as well as a file, and its errors as exceptions with their exit codes."""

from __future__ import annotations

import copy

import pytest
import yaml
from rich.console import Console

import horizon_cli.api as horizon
from horizon_cli.errors import ConfigError, InputError
from tests.conftest import chat_rows, write_config, write_jsonl

QUIET = Console(quiet=True)


def test_plan_train_export_inspect_from_a_mapping(tiny_store, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    path = write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run", train={"steps": 2})
    cfg = yaml.safe_load(path.read_text())
    before = copy.deepcopy(cfg)

    plan = horizon.plan(cfg, ["train.steps=3"], console=QUIET)
    assert plan.fits and plan.memory == "exact" and plan.host_bytes == plan.report["host_bytes"] > 0
    assert not (tmp_path / "run").exists()  # a dry run writes nothing

    run = horizon.train(cfg, ["train.steps=3"], console=QUIET)
    assert cfg == before  # the overrides did not reach the caller's mapping
    assert run.step == 3 and run.run_dir == tmp_path / "run" and run.checkpoint.name == "step_3"
    assert run.final_loss is not None and run.export is None  # output.export: false

    out = horizon.export(run.run_dir, tmp_path / "hf", console=QUIET)
    assert (out.dst / "config.json").is_file() and not out.adapter and out.shards >= 1

    info = horizon.inspect(tiny_store, console=QUIET)
    assert info.params == info.info["params"] > 0 and info.path == "native"

    again = horizon.train(path, ["train.steps=3"], console=QUIET)  # the same run from its file: complete
    assert again.step == 3


def test_errors_are_exceptions_with_exit_codes(tiny_store, tmp_path):
    with pytest.raises(ConfigError) as e:
        horizon.plan({"model": {"path": str(tiny_store)}, "trian": {}}, console=QUIET)
    assert e.value.exit_code == 2 and "trian" in str(e.value)
    with pytest.raises(InputError) as e:
        horizon.convert(tmp_path / "nowhere", tmp_path / "store", console=QUIET)
    assert e.value.exit_code == 2


def test_a_plan_a_start_would_refuse_raises_with_the_plan(tiny_store, tmp_path):
    from horizon_cli import owner
    from horizon_cli.errors import DryRunRefused

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    cfg = yaml.safe_load(write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run").read_text())
    (tmp_path / "run").mkdir()
    lock = owner.DirLock.acquire(tmp_path / "run")  # a start would stop: the run dir is in use
    try:
        with pytest.raises(DryRunRefused) as e:
            horizon.plan(cfg, console=QUIET)
    finally:
        lock.release()
    assert e.value.exit_code == 2 and "is in use by" in str(e.value)
    assert e.value.report["fits"] and e.value.report["ladder"]["exact"]["host_bytes"] > 0
