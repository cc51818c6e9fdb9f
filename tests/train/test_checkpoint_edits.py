"""Edits that keep a checkpoint's files valid and their sizes (a changed digit in trainer.json, the
LoRA scaling in adapter_config.json) are caught by checksums.json: on resume (the checkpoint is
set aside, the one before it resumed) and when the checkpoint is exported by name (refused, one
line). Today's tests flip bits; these edits parse. In-process runs (CliRunner) of the tiny model."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from horizon_cli.store import ckpt
from tests.conftest import chat_rows, horizon, write_config, write_jsonl

LORA = {"r": 2, "alpha": 4, "targets": ["q_proj", "v_proj"]}


def said(r) -> str:
    return " ".join(r.output.split())


@pytest.fixture(scope="module")
def runs(tiny_store, tmp_path_factory):
    """Two finished 2-step runs (checkpoints step_1 and step_2), full fine-tuning and LoRA."""
    tmp = tmp_path_factory.mktemp("edits")
    data = write_jsonl(tmp / "chat.jsonl", chat_rows(16))
    out = {}
    for kind, extra in (("full", {}), ("lora", {"lora": LORA})):
        cfg = write_config(
            tmp / f"{kind}.yaml",
            tiny_store,
            data,
            tmp / kind,
            train={"steps": 2},
            schedule={"kind": "constant"},
            output={"save_every": 1, "keep_last": 2, "export": False},
            **extra,
        )
        r = horizon("train", cfg)
        assert r.exit_code == 0, r.output
        out[kind] = (tmp / kind, cfg)
    return out


def copy_run(runs, kind: str, tmp_path: Path) -> tuple[Path, Path]:
    src, cfg = runs[kind]
    shutil.copytree(src, tmp_path / "run")
    raw = yaml.safe_load(cfg.read_text())
    raw["output"]["dir"] = str(tmp_path / "run")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path / "run", tmp_path / "cfg.yaml"


def edit_same_size(path: Path, pattern: str, repl) -> None:
    """Rewrite the first match of `pattern`; the file keeps its size and stays valid JSON."""
    text = path.read_text()
    new, n = re.subn(pattern, repl, text, count=1)
    assert n == 1 and new != text and len(new.encode()) == len(text.encode())
    json.loads(new)
    path.write_text(new)


def bump_digit(m: re.Match) -> str:
    d = m.group(2)
    return m.group(1) + str((int(d) + 1) % 10)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_valid_same_size_trainer_edit_is_caught_on_resume(runs, tmp_path, kind):
    run_dir, cfg = copy_run(runs, kind, tmp_path)
    step2 = run_dir / "checkpoints" / "step_2"
    edit_same_size(step2 / ckpt.TRAINER, r'("adam_step": )(\d)', bump_digit)
    assert "trainer.json: checksum mismatch" in (ckpt.check(step2) or "")
    r = horizon("train", cfg, "train.steps=3")
    assert r.exit_code == 0, r.output
    out = said(r)
    assert "warning:" in out and "trainer.json: checksum mismatch; kept as" in out and "step_2.damaged" in out
    assert "(step 1)" in out  # the one before it resumed
    assert (run_dir / "checkpoints" / "step_2.damaged").is_dir()
    t = json.loads((run_dir / "checkpoints" / "step_3" / ckpt.TRAINER).read_text())
    assert t["step"] == 3 and t["adam_step"] == 3


@pytest.mark.parametrize(
    "victim,pattern,repl",
    [
        (ckpt.TRAINER, r'("model_fingerprint": "[0-9a-f]*)([0-9])', bump_digit),  # export reads it
        (ckpt.TRAINER, r'("adam_step": )(\d)', bump_digit),
        ("adapter/adapter_config.json", r'("lora_alpha": )(\d)', bump_digit),  # the merge's scaling
    ],
)
def test_exporting_an_edited_lora_checkpoint_by_name_is_refused(runs, tmp_path, victim, pattern, repl):
    run_dir, _ = copy_run(runs, "lora", tmp_path)
    step2 = run_dir / "checkpoints" / "step_2"
    assert horizon("export", step2, tmp_path / "before").exit_code == 0  # intact: exports
    edit_same_size(step2 / victim, pattern, repl)
    r = horizon("export", step2, tmp_path / "out")
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:")
    assert f"{victim}: checksum mismatch (a damaged checkpoint" in said(r)
    assert not (tmp_path / "out").exists()
    r = horizon("export", run_dir, tmp_path / "run-export")  # the run dir: its newest intact one
    assert r.exit_code == 0, r.output


def test_exporting_an_edited_store_checkpoint_by_name_is_refused(runs, tmp_path):
    run_dir, _ = copy_run(runs, "full", tmp_path)
    step2 = run_dir / "checkpoints" / "step_2"
    edit_same_size(step2 / ckpt.TRAINER, r'("adam_step": )(\d)', bump_digit)
    r = horizon("export", step2, tmp_path / "out")
    assert r.exit_code == 2 and "trainer.json: checksum mismatch (a damaged checkpoint" in said(r)
    assert not (tmp_path / "out").exists()
