"""Gradient release in whole `horizon train` runs: a NaN in one layer's gradient leaves the
checkpoint as it was before the step (optim.grad_clip 0: the run stops with one line; > 0: the
step is skipped whole), a run SIGKILLed mid-step resumes bitwise, and 2 ranks under torchrun
train with release bit for bit what they train without."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from horizon_cli.store import ckpt
from horizon_cli.train.metrics import read_metrics
from tests.conftest import chat_rows, write_config, write_jsonl
from tests.parallel.test_dist import torchrun

HORIZON = [sys.executable, "-m", "horizon_cli.cli"]
RELEASE = {"grad_release": True, "grad_clip": 0.0}


def config(tmp_path: Path, store: Path, name: str, optim: dict, steps: int = 4) -> Path:
    data = tmp_path / "chat.jsonl"
    if not data.is_file():
        write_jsonl(data, chat_rows(48))
    return write_config(
        tmp_path / f"{name}.yaml",
        store,
        data,
        tmp_path / name,
        train={"steps": steps},
        optim=optim,
        engine={"compute_threads": 1},
        output={"save_every": 2, "keep_last": 5},
    )


def train(cfg: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*HORIZON, "train", str(cfg)],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def state_files(ck: Path) -> dict[str, bytes]:
    """The checkpoint's trained state, file by file (not its config, trainer.json or sums)."""
    return {str(p.relative_to(ck)): p.read_bytes() for p in sorted((ck / "state").glob("*.bin"))}


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def test_a_nan_after_some_updates_stops_and_keeps_the_last_checkpoint(tiny_store, tmp_path):
    """Step 3's layer.0 gradient is NaN: the head and layer.1 were updated inside the backward
    already, so the run stops (exit 1, one error line) and writes nothing of that state."""
    cfg = config(tmp_path, tiny_store, "nan", RELEASE)
    r = train(cfg, HORIZON_NAN_GRAD="layer.0:3")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "norm-first" not in r.stdout + r.stderr  # grad_clip 0: one pass
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "non-finite gradient (layer.0)" in errors[0], r.stderr
    assert "2 units were already updated" in errors[0]  # the head and layer.1
    assert "optim.grad_clip > 0 (at a resume with train.accept_changes: [optim.grad_clip])" in errors[0]
    assert checkpoints(tmp_path / "nan") == ["step_2"]
    assert ckpt.check(tmp_path / "nan" / "checkpoints" / "step_2", deep=True) is None
    ref = config(tmp_path, tiny_store, "ref", RELEASE, steps=2)
    assert train(ref).returncode == 0
    assert state_files(tmp_path / "nan" / "checkpoints" / "step_2") == state_files(
        tmp_path / "ref" / "checkpoints" / "step_2"
    )


def test_a_nan_with_the_norm_first_pass_skips_the_step_whole(tiny_store, tmp_path):
    cfg = config(tmp_path, tiny_store, "clip", {"grad_release": True, "grad_clip": 1.0})
    r = train(cfg, HORIZON_NAN_GRAD="layer.0:3")
    assert r.returncode == 0, r.stderr
    said = " ".join((r.stdout + r.stderr).split())  # the start says what a step costs (once)
    assert said.count("optim.grad_clip 1 > 0: a norm-first pass") == 1, said
    rows = read_metrics(tmp_path / "clip" / "metrics.jsonl")
    # a skipped step leaves adam_step at 2: the next one is optimizer step 3 again, NaN again
    assert [row["skipped"] for row in rows] == [False, False, True, True]


def test_sigkill_mid_step_resumes_bitwise(tiny_store, tmp_path):
    ref = config(tmp_path, tiny_store, "ref", RELEASE)
    assert train(ref).returncode == 0
    cfg = config(tmp_path, tiny_store, "killed", RELEASE)
    # killed as step 3's top layer's gradient is whole: inside its backward, the head's update and
    # that layer's queued (a timer 40 ms into the step missed a tiny model's whole remaining run)
    r = train(cfg, HORIZON_FAULT="layer-grad:3")
    assert r.returncode == -9, r.stderr
    assert train(cfg).returncode == 0
    last = Path("checkpoints") / "step_4"
    assert state_files(tmp_path / "killed" / last) == state_files(tmp_path / "ref" / last)
    losses = [
        [row["loss"] for row in read_metrics(tmp_path / run / "metrics.jsonl")] for run in ("ref", "killed")
    ]
    assert losses[0] == losses[1]


def test_two_ranks_release_equals_two_ranks_without(tiny_store, tmp_path):
    """Each rank releases its slice after the reduce-scatter: one pass (grad_clip 0) and norm-first
    (grad_clip 0.05: clipping fires), each against the same 2-rank run without release."""
    cases = [
        (f"{on}-{clip}", {"grad_release": on, "grad_clip": clip})
        for clip in (0.0, 0.05)
        for on in (True, False)
    ]
    r = torchrun(2, *(config(tmp_path, tiny_store, name, optim) for name, optim in cases), cli=False)
    assert r.returncode == 0, r.stderr[-3000:]
    last = Path("checkpoints") / "step_4"
    for clip in (0.0, 0.05):
        on, off = tmp_path / f"True-{clip}", tmp_path / f"False-{clip}"
        assert state_files(on / last) == state_files(off / last)
        rows = [read_metrics(run / "metrics.jsonl") for run in (on, off)]
        assert [row["loss"] for row in rows[0]] == [row["loss"] for row in rows[1]]
        if clip:
            assert all(row["grad_norm"] > clip for row in rows[1]), "clipping must fire"
