"""The run dir survives anything: one owner (a lock), a start that fails changes nothing, resume
only with the settings the run was trained with, checksummed checkpoints (a damaged one is set
aside and the one before it resumed), debris of killed processes swept, SIGINT/SIGTERM stop
cleanly, run-time I/O failures are one line. In-process runs (CliRunner) of the tiny model."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from horizon_cli import owner
from horizon_cli.store import ckpt
from tests.conftest import chat_rows, horizon, write_config, write_jsonl


def error_line(r, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    starts = [i for i, ln in enumerate(lines) if ln.startswith("error:")]
    assert len(starts) == 1, r.output
    return " ".join(lines[starts[0] :])


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root (dirs as None) with its bytes: equal snapshots, nothing changed."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


def said(r) -> str:
    return " ".join(r.output.split())  # rich wraps long lines


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture(scope="module")
def trained(tiny_store, tmp_path_factory):
    """A finished 4-step run (checkpoints step_2 and step_4), and its config. A constant schedule:
    these tests resume it with a larger train.steps (under a decay: test_resume_steps.py)."""
    tmp = tmp_path_factory.mktemp("trained")
    data = write_jsonl(tmp / "chat.jsonl", chat_rows(24))
    cfg = write_config(
        tmp / "cfg.yaml", tiny_store, data, tmp / "run", train={"steps": 4}, schedule={"kind": "constant"}
    )
    r = horizon("train", cfg)
    assert r.exit_code == 0, r.output
    return tmp / "run", cfg


@pytest.fixture
def run(trained, tmp_path):
    """A private copy of the trained run dir and a config pointing at it."""
    src, cfg = trained
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    raw = yaml.safe_load(cfg.read_text())
    raw["output"]["dir"] = str(dst)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    return dst, tmp_path / "cfg.yaml"


def steps_in(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


# -- one owner ------------------------------------------------------------------------------------
def test_a_second_train_on_a_run_dir_in_use_exits_2_naming_the_holder(run):
    run_dir, cfg = run
    before = snapshot(run_dir)
    lock = owner.DirLock.acquire(run_dir)  # as a running `horizon train` holds it
    try:
        msg = error_line(horizon("train", cfg, "train.steps=5"))
        assert f"PID {os.getpid()}" in msg and "in use" in msg
        assert "in use by" in said(horizon("train", cfg, "--dry-run"))  # a dry run says so too
    finally:
        lock.release()
    assert snapshot(run_dir) == before


def test_a_stale_lock_of_a_dead_process_is_taken_over(run):
    run_dir, cfg = run
    (run_dir / ".lock").write_text(f"{dead_pid()} somehost x\n")  # left by a killed run: no flock
    r = horizon("train", cfg, "train.steps=5")
    assert r.exit_code == 0, r.output
    assert "resuming" in said(r) and not (run_dir / ".lock").exists()


# -- a start that fails changes nothing -----------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["optim.lr=1e-3", "train.seed=2", "train.steps=6"], "train.seed 1 -> 2, optim.lr 0.003 -> 0.001"),
        (["engine.dtype=bfloat16", "train.steps=6"], "engine.dtype"),
        (["data.max_seq_len=4096", "train.steps=6"], "max_seq_len"),
        (["train.accept_changes=[optim.lrr]"], "not a config key"),
        (["train.batch_size=400000000", "train.micro_batch_size=1"], "does not fit"),
    ],
)
def test_a_failed_start_changes_nothing(run, overrides, needle):
    run_dir, cfg = run
    before = snapshot(run_dir)
    msg = error_line(horizon("train", cfg, *overrides))
    assert needle in msg
    assert snapshot(run_dir) == before


def test_bad_data_on_an_existing_run_dir_changes_nothing(run, tmp_path):
    run_dir, cfg = run
    before = snapshot(run_dir)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"nothing": "here"}])
    r = horizon("train", cfg, f"data.path={bad}", "train.accept_changes=[data]", "train.steps=5")
    assert "bad.jsonl" in error_line(r)
    assert snapshot(run_dir) == before


def test_a_failed_start_does_not_leave_a_new_run_dir(run, tmp_path):
    _, cfg = run
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"nothing": "here"}])
    new = tmp_path / "new" / "run"
    error_line(horizon("train", cfg, f"data.path={bad}", f"output.dir={new}"))
    assert not (tmp_path / "new").exists()


@pytest.fixture
def flipped(tiny_store, tmp_path) -> Path:
    """A copy of the tiny store with one flipped byte: found while the weights load, after the
    data was tokenized into <run>/cache."""
    dst = Path(shutil.copytree(tiny_store, tmp_path / "flipped"))
    unit = dst / "units" / "head.bin"
    raw = bytearray(unit.read_bytes())
    raw[100] ^= 1
    unit.write_bytes(bytes(raw))
    return dst


def test_a_start_that_fails_late_removes_the_run_dir_it_created(run, flipped, tmp_path):
    _, cfg = run
    new = tmp_path / "new" / "run"
    msg = error_line(horizon("train", cfg, f"model.path={flipped}", f"output.dir={new}"))
    assert "checksum mismatch" in msg
    assert not (tmp_path / "new").exists()  # not runs/new/run/cache/...


def test_a_start_that_fails_late_leaves_an_existing_run_dir_as_it_was(run, flipped, tmp_path):
    _, cfg = run
    mine = tmp_path / "mine"
    (mine / "cache" / "other-0123").mkdir(parents=True)  # a cache entry of other data, kept
    (mine / "cache" / "other-0123" / "meta.json").write_text("{}")
    (mine / "notes.txt").write_text("the user's\n")
    before = snapshot(mine)
    error_line(horizon("train", cfg, f"model.path={flipped}", f"output.dir={mine}"))
    assert snapshot(mine) == before
    shutil.rmtree(mine / "cache")  # a cache/ the start had to make goes too
    before = snapshot(mine)
    error_line(horizon("train", cfg, f"model.path={flipped}", f"output.dir={mine}"))
    assert snapshot(mine) == before


# -- resume with the same settings ----------------------------------------------------------------
def test_accepted_changes_resume_and_the_checkpoint_records_its_config(run):
    run_dir, cfg = run
    r = horizon("train", cfg, "optim.lr=1e-3", "train.steps=6", "train.accept_changes=[optim]")
    assert r.exit_code == 0, r.output
    assert "changed setting: optim.lr 0.003 -> 0.001" in said(r)
    saved = yaml.safe_load((run_dir / "checkpoints" / "step_6" / ckpt.CONFIG).read_text())
    assert saved["optim"]["lr"] == 1e-3 and saved["train"]["steps"] == 6
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["lr"] == 1e-3


def test_free_settings_may_change(run):
    run_dir, cfg = run
    r = horizon(
        "train",
        cfg,
        "train.steps=5",
        "log.every=2",
        "output.save_every=1",
        "engine.prefetch=1",
        "output.keep_last=3",
    )
    assert r.exit_code == 0, r.output
    assert "(step 4)" in said(r) and "changed setting" not in said(r)
    assert steps_in(run_dir) == ["step_2", "step_4", "step_5"]


def test_a_finished_run_says_so_and_does_nothing(run):
    run_dir, cfg = run
    before = snapshot(run_dir)
    r = horizon("train", cfg)
    assert r.exit_code == 0, r.output
    assert "complete at step 4" in said(r) and "nothing to do" in said(r)
    assert snapshot(run_dir) == before
    assert "complete at step 4" in said(horizon("train", cfg, "--dry-run"))


def test_a_trained_run_killed_before_its_export_only_exports(run):
    run_dir, cfg = run
    r = horizon("train", cfg, "output.export=true")  # finished.json says: nothing exported yet
    assert r.exit_code == 0, r.output
    assert (run_dir / "export" / "config.json").is_file() and "resuming" not in said(r)
    assert json.loads((run_dir / "finished.json").read_text())["export"] is True


# -- checksums: a damaged checkpoint is set aside, the one before it resumed ---------------------
@pytest.mark.parametrize(
    "victim",
    ["units/layer_0000.bin", "state/layer.0.m.bin", "state/trainer.json", "checksums.json"],
)
def test_a_damaged_latest_checkpoint_is_set_aside(run, victim):
    run_dir, cfg = run
    step4 = run_dir / "checkpoints" / "step_4"
    good = {p: (step4 / p).read_bytes() for p in ("state/layer.0.m.bin", "units/layer_0000.bin")}
    f = step4 / victim
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0x10  # one flipped bit, in the data (unit files: past the padding)
    if victim.startswith("units/"):
        data[100] ^= 0x10
    f.write_bytes(bytes(data))
    damaged = snapshot(step4)
    assert ckpt.check(step4, deep=True) is not None
    (run_dir / "finished.json").unlink()  # killed after its last checkpoint: a unit file's damage
    r = horizon("train", cfg)  # is then found by the deep check before the finish
    assert r.exit_code == 0, r.output
    out = said(r)
    assert "warning:" in out and "step_4.damaged" in out and "(step 2)" in out
    assert snapshot(run_dir / "checkpoints" / "step_4.damaged") == damaged  # kept, never deleted
    assert {p: (step4 / p).read_bytes() for p in good} == good  # retrained bitwise the same


def test_a_corrupt_trainer_state_is_caught_by_its_checksum(run):
    """trainer.json has no checksum of its own inside: checksums.json covers it."""
    step4 = run[0] / "checkpoints" / "step_4"
    t = json.loads((step4 / ckpt.TRAINER).read_text())
    t["adam_step"] += 1
    (step4 / ckpt.TRAINER).write_text(json.dumps(t, indent=1))
    assert "trainer.json" in (ckpt.check(step4) or "")
    assert ckpt.latest(run[0]).name == "step_2"  # what `horizon export RUN` would take


# -- debris of killed processes -------------------------------------------------------------------
def test_debris_of_dead_processes_is_swept_and_live_ones_kept(run):
    run_dir, cfg = run
    me = owner.me()
    dead = f"{me.host}-{me.boot}-{dead_pid()}-1"
    reused = f"{me.host}-{me.boot}-{me.pid}-{me.start + 1}"  # our PID, another start: PID reused
    foreign = f"abcdef-{me.boot}-{dead_pid()}-1"  # another host: cannot judge, left alone
    ck = run_dir / "checkpoints"
    debris = [
        ck / f".step_6.tmp-{dead}-aaaaaa",  # a checkpoint being written
        ck / f".step_2.del-{reused}-bbbbbb",  # a checkpoint being pruned
        run_dir / f".export.tmp-{dead}-cccccc",  # an export being written
    ]
    for d in debris:
        (d / "state").mkdir(parents=True)
    (run_dir / f".config.yaml.tmp-{dead}-dddddd").write_text("half")
    kept = [ck / f".step_8.tmp-{foreign}-eeeeee", run_dir / owner.temp_name("mine")]
    for d in kept:
        d.mkdir()
    r = horizon("train", cfg, "train.steps=5")
    assert r.exit_code == 0, r.output
    assert all(d.exists() for d in kept)
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")) == sorted(
        p.name for p in kept if p.parent == run_dir
    )
    assert steps_in(run_dir) == sorted(["step_4", "step_5", kept[0].name])


def test_keep_last_holds_after_a_kill_between_rename_and_prune(run):
    run_dir, cfg = run
    (run_dir / "finished.json").unlink()  # killed after renaming step_4 into place, before pruning
    r = horizon("train", cfg, "output.keep_last=1")  # nothing left to train: only the finish runs
    assert r.exit_code == 0, r.output
    assert steps_in(run_dir) == ["step_4"]


def test_atomic_dir_leaves_nothing_when_interrupted_right_after_creating_it(tmp_path, monkeypatch):
    from horizon_cli import fsutil

    real = os.mkdir

    def mkdir_then_signal(path, mode=0o777, **kw):
        real(path, mode, **kw)
        raise KeyboardInterrupt  # a signal between creating the temp dir and owning it

    monkeypatch.setattr(fsutil.os, "mkdir", mkdir_then_signal)
    with pytest.raises(KeyboardInterrupt), fsutil.atomic_dir(tmp_path / "out"):
        pass
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_export_sweeps_temp_dirs_of_a_killed_export(run, tmp_path):
    run_dir, _ = run
    me = owner.me()
    stale = tmp_path / f".hf.tmp-{me.host}-{me.boot}-{dead_pid()}-1-ffffff"
    stale.mkdir()
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"half")
    r = horizon("export", run_dir, tmp_path / "hf")
    assert r.exit_code == 0, r.output
    assert not stale.exists() and (tmp_path / "hf" / "config.json").is_file()


# -- SIGINT and SIGTERM ---------------------------------------------------------------------------
@pytest.fixture
def sigint(request):
    """SIGINT's disposition for the test (`default`: Python's KeyboardInterrupt; `ignored`: as a
    script's background job inherits it), restored after. The suite itself may have been started
    either way, so no test relies on what it inherited."""
    old = signal.getsignal(signal.SIGINT)
    how = getattr(request, "param", "default")
    signal.signal(signal.SIGINT, signal.default_int_handler if how == "default" else signal.SIG_IGN)
    yield how
    signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize(
    "sig,code,where",
    [
        (signal.SIGTERM, 143, "after-step"),
        (signal.SIGINT, 130, "after-step"),
        (signal.SIGTERM, 143, "checkpoint-written"),
    ],
)
def test_a_signal_stops_the_run_cleanly(run, monkeypatch, sigint, sig, code, where):
    from horizon_cli.train import checkpoint, loop

    run_dir, cfg = run
    real = loop.phase

    def send(name, step=None):
        real(name, step)
        if name == where and step == 5:
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(loop, "phase", send)
    monkeypatch.setattr(checkpoint, "phase", send)
    r = horizon("train", cfg, "train.steps=8", "output.save_every=1", "output.keep_last=8")
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output
    assert steps_in(run_dir) == ["step_2", "step_4"]  # step_5 never landed; the others intact
    assert all(ckpt.check(c, deep=True) is None for c in ckpt.listed(run_dir))
    assert not [p for p in run_dir.rglob(".*")]  # no temp dir, no lock
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


@pytest.mark.parametrize("sigint", ["ignored"], indirect=True)
def test_an_inherited_ignored_sigint_stays_ignored(run, monkeypatch, sigint):
    """A script's `horizon train ... &` inherits SIGINT ignored (so Ctrl-C in the terminal reaches
    the foreground only): horizon keeps that, the run goes on, SIGTERM still stops it."""
    from horizon_cli.train import loop

    run_dir, cfg = run
    real = loop.phase

    def send(name, step=None):
        real(name, step)
        if name == "after-step" and step == 5:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(loop, "phase", send)
    r = horizon("train", cfg, "train.steps=6")
    assert r.exit_code == 0, r.output
    assert "step_6" in steps_in(run_dir)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


# -- metrics --------------------------------------------------------------------------------------
def test_a_garbled_metrics_line_never_deletes_history(run):
    run_dir, cfg = run
    m = run_dir / "metrics.jsonl"
    lines = m.read_text().splitlines()
    lines[1] = lines[1][: len(lines[1]) // 2]  # a line cut short
    m.write_text(
        "\n".join([*lines, json.dumps({"step": 9, "loss": 1.0})]) + "\n"
    )  # and one past the checkpoint
    r = horizon("train", cfg, "train.steps=5")
    assert r.exit_code == 0, r.output
    assert "dropped 1 unreadable line" in said(r)
    assert [json.loads(x)["step"] for x in m.read_text().splitlines()] == [1, 3, 4, 5]


# -- run-time I/O failures: one line, exit 1 ------------------------------------------------------
class _FullFile:
    def __init__(self, err: int):
        self.err = err

    def write(self, data):
        raise OSError(self.err, os.strerror(self.err))

    flush = close = fileno = lambda self: None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _failing_open(needle: str, err: int):
    real = open

    def fake(path, mode="r", *a, **kw):
        if needle in str(path) and ("w" in mode or "a" in mode):
            real(path, mode).close()  # the file exists, as on a real disk; its write fails
            return _FullFile(err)
        return real(path, mode, *a, **kw)

    return fake


@pytest.mark.parametrize(
    "module,needle,err",
    [
        ("horizon_cli.train.metrics", "metrics.jsonl", errno.ENOSPC),
        ("horizon_cli.fsutil", "config.yaml", errno.EFBIG),
    ],
)
def test_a_full_disk_on_run_outputs_is_one_line(run, monkeypatch, module, needle, err):
    run_dir, cfg = run
    before = (run_dir / needle).read_bytes()
    monkeypatch.setattr(sys.modules[module], "open", _failing_open(needle, err), raising=False)
    msg = error_line(horizon("train", cfg, "train.steps=5"), code=1)
    assert needle in msg and os.strerror(err) in msg
    if needle == "config.yaml":  # nothing half-written (metrics.jsonl is appended to, by design)
        assert (run_dir / needle).read_bytes() == before
    assert not [p for p in run_dir.rglob(".*")]  # no temp file, no lock
    assert steps_in(run_dir) == ["step_2", "step_4"]


def test_a_full_disk_writing_a_checkpoint_is_one_line(run, monkeypatch):
    """ENOSPC while the checkpoint copies the store's hf/ files (shutil.copytree would collect it
    into a list of (src, dst, why) tuples and print that): the line docs/reliability.md promises."""
    run_dir, cfg = run
    real = shutil.copyfile

    def full(src, dst, *a, **kw):
        if ".step_5" in str(dst):  # the checkpoint's temp dir
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(shutil, "copyfile", full)
    msg = error_line(horizon("train", cfg, "train.steps=5"), code=1)
    want = f"error: {run_dir}/checkpoints/step_5: could not write the checkpoint (No space left on device); "
    assert msg == want + "earlier ones are intact"
    assert steps_in(run_dir) == ["step_2", "step_4"]
    assert not [p for p in run_dir.rglob(".*")]  # no temp dir, no lock


def test_a_full_disk_on_the_loss_plot_is_one_line(run, monkeypatch):
    import matplotlib.figure

    run_dir, cfg = run

    def efbig(self, *a, **kw):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", efbig)
    msg = error_line(horizon("train", cfg, "train.steps=5", "log.plot=true"), code=1)
    assert "loss.png" in msg and "File too large" in msg
    assert not (run_dir / "loss.png").exists()


@pytest.mark.parametrize(
    "what,exc,needle",
    [
        ("thread", RuntimeError("can't start new thread"), "cannot start a thread"),
        ("memory", MemoryError(), "out of host memory"),
    ],
)
def test_no_threads_or_no_memory_is_one_line(run, monkeypatch, what, exc, needle):
    from horizon_cli.engine import build

    run_dir, cfg = run

    def fail(*a, **kw):
        raise exc

    monkeypatch.setattr(build, "Engine", fail)
    msg = error_line(horizon("train", cfg, "train.steps=5"), code=1)
    assert needle in msg
    assert steps_in(run_dir) == ["step_2", "step_4"]


# -- small things ---------------------------------------------------------------------------------
def test_checkpoint_dirs_follow_the_umask(tiny_store, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    cfg = write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run", train={"steps": 1})
    old = os.umask(0o027)
    try:
        r = horizon("train", cfg)
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    ck = tmp_path / "run" / "checkpoints" / "step_1"
    assert (ck.stat().st_mode & 0o777) == 0o750
    assert ((ck / "state").stat().st_mode & 0o777) == 0o750


def test_a_plain_file_is_not_a_store(run, tmp_path):
    _, cfg = run
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    assert "not a horizon store" in error_line(horizon("train", cfg, f"model.path={f}"))
    assert "not a horizon store" in error_line(horizon("inspect", f))


def test_progress_keeps_elapsed_and_eta_readable_at_80_columns():
    import io
    import re

    from rich.console import Console
    from rich.progress import Progress

    from horizon_cli.progress import train_columns

    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=True, color_system=None)
    fields = "loss {task.fields[loss]} lr 3.00e-03 12,345 tok/s RAM 431.82 MiB and more fields"
    with Progress(*train_columns(1000, fields), console=console, auto_refresh=False) as prog:
        task = prog.add_task("train", total=1000, completed=5, loss="1.2345")
        prog.refresh()
    line = buf.getvalue().split("\r")[-1]
    assert re.search(r"5/1000 +\d+:\d\d:\d\d +(\d+:\d\d:\d\d|-:--:--) +loss", line), line
    assert task is not None
