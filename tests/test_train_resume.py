"""Crash safety: a run killed with SIGKILL at any point and resumed ends bitwise identical to an
uninterrupted run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import chat_rows, write_config, write_jsonl

from horizon_cli.train.metrics import read_metrics

HORIZON = [sys.executable, "-m", "horizon_cli.cli"]


def train(cfg: Path, fault: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "HORIZON_FAULT": fault, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*HORIZON, "train", str(cfg)], env=env, capture_output=True, text=True, timeout=300)


def final_state(run: Path) -> dict[str, bytes]:
    ck = run / "checkpoints" / "step_6"
    files = sorted(p for p in ck.rglob("*.bin"))
    assert files, f"no checkpoint in {run}"
    return {str(p.relative_to(ck)): p.read_bytes() for p in files}


@pytest.fixture(scope="module")
def reference(tiny_store, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    data = write_jsonl(tmp / "chat.jsonl", chat_rows())
    cfg = write_config(tmp / "cfg.yaml", tiny_store, data, tmp / "run")
    r = train(cfg)
    assert r.returncode == 0, r.stderr
    return data, final_state(tmp / "run"), [m["loss"] for m in read_metrics(tmp / "run" / "metrics.jsonl")]


@pytest.mark.parametrize(
    "fault,resume_from",
    [
        ("checkpoint-synced:2", None),  # the first checkpoint never landed: start over
        ("after-step:3", 2),
        ("checkpoint-written:4", 2),  # step_4 half-written: step_2 is intact
        ("checkpoint-renamed:4", 4),  # killed before pruning and the rest of the step
        ("after-step:5", 4),
    ],
)
def test_killed_run_resumes_bitwise_identical(tiny_store, reference, tmp_path, fault, resume_from):
    data, ref_state, ref_losses = reference
    cfg = write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run")
    killed = train(cfg, fault)
    assert killed.returncode == -9, killed.stderr  # SIGKILL
    resumed = train(cfg)
    assert resumed.returncode == 0, resumed.stderr
    said = "".join(resumed.stdout.split())  # rich wraps long lines
    assert (f"(step{resume_from})" in said) if resume_from else ("resuming" not in said)
    assert final_state(tmp_path / "run") == ref_state
    losses = [m["loss"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert losses == ref_losses  # metrics past the checkpoint were rewritten, not duplicated
    assert not list((tmp_path / "run" / "checkpoints").glob(".step_*"))  # no temp dirs left


def test_killed_at_a_random_moment(tiny_store, reference, tmp_path):
    """SIGKILL from outside at an arbitrary time (start-up, a step, a checkpoint write...)."""
    import random
    import signal
    import time

    data, ref_state, _ = reference
    cfg = write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [*HORIZON, "train", str(cfg)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    time.sleep(random.Random(os.getpid()).uniform(2.5, 4.5))  # past imports, somewhere in training
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = train(cfg)
    assert resumed.returncode == 0, resumed.stderr
    assert final_state(tmp_path / "run") == ref_state


def test_full_disk_keeps_the_previous_checkpoint(tiny_store, tmp_path, monkeypatch):
    """A checkpoint write that fails (ENOSPC) leaves earlier checkpoints intact and no temp dir."""
    import errno

    from oracle import make_engine

    from horizon_cli.errors import HorizonError
    from horizon_cli.store import Store
    from horizon_cli.store import checkpoint as ckpt
    from horizon_cli.train import checkpoint

    eng = make_engine(Store.open(tiny_store))
    try:
        trainer = {"step": 2, "adam_step": 0}
        first = checkpoint.save(eng, tmp_path, 2, trainer, "", Store.open(tiny_store), keep_last=2)
        before = {p.name: p.read_bytes() for p in first.rglob("*") if p.is_file()}

        def full(path, t):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(checkpoint, "_write_raw", full)
        with pytest.raises(HorizonError, match="No space left"):
            checkpoint.save(eng, tmp_path, 4, {**trainer, "step": 4}, "", Store.open(tiny_store), keep_last=2)
        assert ckpt.latest(tmp_path) == first
        assert {p.name: p.read_bytes() for p in first.rglob("*") if p.is_file()} == before
        assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_2"]
    finally:
        eng.close()
