"""Crash safety: a run killed with SIGKILL at any point and run again ends bitwise identical to an
uninterrupted run, with no debris (no temp dirs, no lock, keep_last respected).

The crash soak kills a run again and again (each kill followed by a re-run, which may be killed
in turn) at moments spread over every phase of a run: start-up, steps, checkpoint writes,
pruning, export. Where each kill landed is read from the phase log the run writes
(HORIZON_PHASES, see horizon_cli/faults.py) and asserted. A kill at a phase mark (delay 0) lands
exactly there; the slow soak adds kills at random delays after a mark and from outside at random
times, whose landing is recorded (not assumed).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from horizon_cli.train.metrics import read_metrics
from tests.conftest import chat_rows, write_config, write_jsonl

HORIZON = [sys.executable, "-m", "horizon_cli.cli"]
SECTIONS = {"output": {"export": True, "keep_last": 1, "save_every": 2}}  # 6 steps: step_2, _4, _6
GROUPS = {
    "startup": ("startup", "locked", "load"),
    "step": ("step", "after-step"),
    "checkpoint": (
        "checkpoint",
        "checkpoint-store",
        "checkpoint-written",
        "checkpoint-synced",
        "checkpoint-renamed",
    ),
    "prune": ("prune", "prune-renamed"),
    "export": ("export", "atomic-dir-filled"),
    "finish": ("finished",),
}
GROUP_OF = {mark: g for g, marks in GROUPS.items() for mark in marks}


def env(fault: str = "", phases: Path | None = None) -> dict:
    return {**os.environ, "HORIZON_FAULT": fault, "HORIZON_PHASES": str(phases or ""), "OMP_NUM_THREADS": "1"}


def train(cfg: Path, fault: str = "", phases: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*HORIZON, "train", str(cfg)], env=env(fault, phases), capture_output=True, text=True, timeout=300
    )


def marks(phases: Path) -> list[tuple[str, str, float]]:
    if not phases.is_file():
        return []
    return [(a, b, float(c)) for a, b, c in (ln.split() for ln in phases.read_text().splitlines())]


def landed(phases: Path) -> str:
    """The phase group a kill landed in: that of the last mark written (start-up before any)."""
    m = marks(phases)
    return GROUP_OF[m[-1][0]] if m else "startup"


def outcome(run: Path) -> dict:
    """What must be bitwise equal to an uninterrupted run: the final checkpoint's files (all but
    its config, which names the run dir, and the checksums of that), the export, the losses."""
    ck = run / "checkpoints" / "step_6"
    skip = {"state/config.yaml", "checksums.json"}
    files = {f"ck/{p.relative_to(ck)}": p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    files = {k: v for k, v in files.items() if k[3:] not in skip}
    trainer = json.loads(files.pop("ck/state/trainer.json"))
    trainer.pop("rng")  # a fresh process starts from an unseeded RNG state that training never uses
    files["ck/state/trainer.json"] = json.dumps(trainer, sort_keys=True).encode()
    files |= {f"export/{p.name}": p.read_bytes() for p in (run / "export").iterdir()}
    losses = [m["loss"] for m in read_metrics(run / "metrics.jsonl")]
    assert len(losses) == 6 and any(k.endswith(".m.bin") for k in files), sorted(files)
    return {"files": files, "losses": losses}


def assert_no_debris(run: Path) -> None:
    assert sorted(p.name for p in run.iterdir()) == [
        "cache", "checkpoints", "config.yaml", "export", "finished.json", "metrics.jsonl",
    ]  # fmt: skip
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_6"]  # keep_last: 1
    hidden = [p for p in run.rglob(".*") if "cache" not in p.relative_to(run).parts]
    assert hidden == []  # no temp dir, no half-pruned checkpoint, no lock


@pytest.fixture(scope="module")
def reference(tiny_store, tmp_path_factory):
    """An uninterrupted run: its outcome, its config's data file, and its phase log (times)."""
    tmp = tmp_path_factory.mktemp("ref")
    data = write_jsonl(tmp / "chat.jsonl", chat_rows())
    cfg = write_config(tmp / "cfg.yaml", tiny_store, data, tmp / "run", **SECTIONS)
    r = train(cfg, phases=tmp / "phases")
    assert r.returncode == 0, r.stderr
    assert_no_debris(tmp / "run")
    return data, outcome(tmp / "run"), marks(tmp / "phases")


@pytest.fixture
def fresh(tiny_store, reference, tmp_path):
    data = reference[0]
    return write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run", **SECTIONS)


@pytest.mark.parametrize(
    "fault,resume_from",
    [
        # the fast tier keeps two (a kill between steps, a half-written checkpoint); the slow tier the rest
        # the first checkpoint never landed: start over
        pytest.param("checkpoint-synced:2", None, marks=pytest.mark.slow),
        ("after-step:3", 2),
        ("checkpoint-written:4", 2),  # step_4 half-written: step_2 is intact
        # killed before pruning step_2: keep_last holds after the re-run
        pytest.param("checkpoint-renamed:4", 4, marks=pytest.mark.slow),
        # killed while deleting step_2: the re-run finishes it off
        pytest.param("prune-renamed:2", 4, marks=pytest.mark.slow),
        pytest.param("after-step:5", 4, marks=pytest.mark.slow),
    ],
)
def test_killed_run_resumes_bitwise_identical(reference, fresh, fault, resume_from):
    _, ref, _ = reference
    run = fresh.parent / "run"
    killed = train(fresh, fault)
    assert killed.returncode == -9, killed.stderr  # SIGKILL
    resumed = train(fresh)
    assert resumed.returncode == 0, resumed.stderr
    said = "".join(resumed.stdout.split())  # rich wraps long lines
    assert (f"(step{resume_from})" in said) if resume_from else ("resuming" not in said)
    assert outcome(run) == ref  # metrics past the checkpoint were rewritten, not duplicated
    assert_no_debris(run)


def soak(cfg: Path, kills: list[tuple[str, float]], phases: Path) -> list[tuple[str, str]]:
    """Run `cfg` once per kill (each run killed at `mark+ms`, or from outside after `ms` when mark
    is "outside"), then once to the end. Returns [(kill, the phase group where it landed)]; a run
    that finishes before its kill ends the list (the run dir is complete)."""
    out = []
    for mark, ms in kills:
        phases.unlink(missing_ok=True)
        if mark == "outside":
            p = subprocess.Popen([*HORIZON, "train", str(cfg)], env=env(phases=phases), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
            time.sleep(ms / 1000)
            p.send_signal(signal.SIGKILL)
            _, err = p.communicate(timeout=300)
            rc = p.returncode
        else:
            r = train(cfg, f"{mark}+{ms:.1f}", phases)
            rc, err = r.returncode, r.stderr.encode()
        if rc == 0:  # finished before the kill: the run dir is complete, the rest is moot
            out.append((f"{mark}+{ms:.0f}ms", "none: the run finished first"))
            break
        assert rc == -9, err.decode(errors="replace")[-2000:]
        out.append((f"{mark}+{ms:.0f}ms", landed(phases)))
    final = train(cfg)
    assert final.returncode == 0, final.stderr
    return out


@pytest.mark.slow  # ~1 min: random kills; the fixed ones above stay in the fast tier
def test_crash_soak_short(reference, fresh, tmp_path):
    """Three kills at marks drawn at random from the checkpoint, prune and export phases."""
    _, ref, _ = reference
    seed = int(os.environ.get("SOAK_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    kills = [
        (rng.choice(GROUPS["checkpoint"]) + ":4", 0.0),
        (rng.choice(GROUPS["prune"]) + ":2", 0.0),
        (rng.choice(GROUPS["export"]), 0.0),
    ]
    got = soak(fresh, kills, tmp_path / "phases")
    assert [g for _, g in got] == ["checkpoint", "prune", "export"], (seed, got)
    assert outcome(fresh.parent / "run") == ref, seed
    assert_no_debris(fresh.parent / "run")


def windows(ref_marks) -> dict[tuple[str, str], float]:
    """(mark, step) -> ms from that mark to the end of its phase group in the reference run;
    (mark, "-") for a mark's first occurrence."""
    out: dict[tuple[str, str], float] = {}
    for i, (name, step, t) in enumerate(ref_marks):
        end = next((u for n, _, u in ref_marks[i + 1 :] if GROUP_OF[n] != GROUP_OF[name]), t)
        out[(name, step)] = (end - t) * 1000
        out.setdefault((name, "-"), (end - t) * 1000)
    return out


def slow_round(rng: random.Random, win: dict, deterministic: bool) -> list[tuple[str, float]]:
    """Six kills in the order a run meets them: from outside (during imports or start-up),
    start-up, a step, a checkpoint write, a prune, the export. The first round kills exactly at
    marks drawn at random; later rounds at random moments inside each phase (a random delay,
    up to the phase's length in the reference run, after a random mark)."""

    def at(group: str, step: str) -> tuple[str, float]:
        mark = rng.choice(GROUPS[group])
        delay = 0.0 if deterministic else rng.uniform(0, win.get((mark, step), 0.0))
        return mark + ("" if step == "-" else f":{step}"), delay

    return [
        ("outside", rng.uniform(300, 4000)),
        at("startup", "-"),
        at("step", str(rng.choice([1, 2, 3]))),
        at("checkpoint", "4"),
        at("prune", "2"),
        at("export", "-"),
    ]


@pytest.mark.slow
def test_crash_soak(tiny_store, reference, tmp_path):
    """At least 20 SIGKILLs at moments spread over every phase, in rounds of six, each round
    ending bitwise equal to the uninterrupted run with no debris."""
    data, ref, ref_marks = reference
    seed = int(os.environ.get("SOAK_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    win = windows(ref_marks)
    history: list[tuple[str, str]] = []
    r = 0
    while sum(w in GROUPS for _, w in history) < 20:
        cfg = write_config(tmp_path / f"cfg{r}.yaml", tiny_store, data, tmp_path / f"run{r}", **SECTIONS)
        history += soak(cfg, slow_round(rng, win, deterministic=r == 0), tmp_path / "phases")
        assert outcome(tmp_path / f"run{r}") == ref, (seed, history)
        assert_no_debris(tmp_path / f"run{r}")
        r += 1
    print(f"\nsoak seed {seed}: {sum(w in GROUPS for _, w in history)} kills in {r} rounds")
    for kill, where in history:
        print(f"  {kill:<32} landed in {where}")
    assert {"startup", "step", "checkpoint", "prune", "export"} <= {w for _, w in history}, history


def test_full_disk_keeps_the_previous_checkpoint(tiny_store, tmp_path, monkeypatch):
    """A checkpoint write that fails (ENOSPC) leaves earlier checkpoints intact and no temp dir."""
    import errno

    from horizon_cli.errors import HorizonError
    from horizon_cli.store import Store, ckpt
    from horizon_cli.train import checkpoint
    from tests.support.oracle import make_engine

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
