"""train.steps on resume (train/compat.py): under a decaying schedule a change under which the steps
already trained would have run at another lr is refused with the lr before and after, unless
train.accept_changes names train.steps; with a constant schedule (or inside the warmup) it may grow
or shrink to the step reached, and the resumed run is the run its config describes; below the step
reached it is refused always. In-process, on resolved configs; tests/train/test_run_dir.py-style runs at
the end."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import yaml

from horizon_cli.config import dump_yaml, load_config
from horizon_cli.errors import InputError
from horizon_cli.optim.schedules import lr_at
from horizon_cli.train.compat import check_resume
from tests.conftest import chat_rows, horizon, write_config, write_jsonl

BASE = {
    "model": {"path": "store"},
    "data": {"path": "d.jsonl"},
    "optim": {"lr": 1.0e-3},
    "schedule": {"kind": "cosine", "warmup_steps": 0},
    "train": {"steps": 10},
    "output": {"dir": "run"},
}


def cfg(*over: str):
    return load_config(None, over, base=copy.deepcopy(BASE))


def resume(trained_with: list[str], now: list[str], step: int) -> list[str]:
    """check_resume of a checkpoint at `step` written with `trained_with`, resumed with `now`."""
    return check_resume(dump_yaml(cfg(*trained_with)), cfg(*now), "run/checkpoints/step_N", step)


def refusal(trained_with, now, step) -> str:
    with pytest.raises(InputError) as e:
        resume(trained_with, now, step)
    return str(e.value)


def test_growing_a_cosine_run_is_refused_with_the_lr_before_and_after():
    """The issue's run: cosine over 10 steps, resumed at step 10 with train.steps 20, would jump
    from 2.45e-5 to 5.0e-4."""
    msg = refusal(["train.steps=10"], ["train.steps=20"], 10)
    assert (
        "train.steps 10 -> 20 moves the learning rate of the cosine schedule: step 10 ran at 2.45e-05, "
        "step 11 would run at 0.0005 (train.steps 20 from the start: step 10 at 0.000578)"
    ) in msg
    assert msg.endswith("add train.accept_changes=[train.steps], or use another output.dir")


def test_shrinking_a_cosine_run_is_refused_with_the_lr_before_and_after():
    msg = refusal(["train.steps=400"], ["train.steps=100"], 90)
    assert (
        "step 90 ran at 0.000883, step 91 would run at 2.45e-05 (train.steps 100 from the start: step 90 at 2.96e-05)"
        in msg
    )
    # ending it at the step reached leaves no step to run, but step 90 was no step of a 90-step run
    msg = refusal(["train.steps=400"], ["train.steps=90"], 90)
    assert (
        "step 90 ran at 0.000883, the run would end there (train.steps 90 from the start: step 90 at 3.05e-07)"
        in msg
    )


@pytest.mark.parametrize(
    "schedule",
    [
        ["schedule.kind=linear"],
        ["schedule.kind=cosine", "schedule.warmup_steps=3"],
        ["schedule.kind=linear", "schedule.warmup_steps=3", "schedule.min_lr_ratio=0.1"],
    ],
)
def test_any_decay_is_a_trajectory_change(schedule):
    assert "moves the learning rate" in refusal(
        [*schedule, "train.steps=100"], [*schedule, "train.steps=150"], 8
    )


def test_inside_the_warmup_no_trained_step_moves():
    """Resumed before the decay starts, the steps trained ran at the lr a run of the new length
    gives them: the resumed run is that run (test_lean's bitwise resume extends 2 -> 4 so)."""
    w = ["schedule.kind=cosine", "schedule.warmup_steps=30"]
    assert resume([*w, "train.steps=100"], [*w, "train.steps=150"], 31) == []
    assert "moves" in refusal([*w, "train.steps=100"], [*w, "train.steps=150"], 32)


def test_an_accepted_change_resumes_and_is_noted():
    lines = resume(["train.steps=10"], ["train.steps=20", "train.accept_changes=[train.steps]"], 10)
    assert lines == [
        "train.steps 10 -> 20 moves the learning rate of the cosine schedule: step 10 ran at 2.45e-05, "
        "step 11 would run at 0.0005 (train.steps 20 from the start: step 10 at 0.000578)"
    ]
    assert resume(["train.steps=10"], ["train.steps=20", "train.accept_changes=[train]"], 10)


@pytest.mark.parametrize(
    "schedule",
    [
        ["schedule.kind=constant"],
        ["schedule.kind=constant", "schedule.warmup_steps=50"],
        ["schedule.kind=cosine", "schedule.min_lr_ratio=1.0"],
    ],  # fmt: skip
)
def test_without_decay_train_steps_may_grow_or_shrink_to_the_step_reached(schedule):
    assert resume([*schedule, "train.steps=10"], [*schedule, "train.steps=20"], 10) == []
    assert resume([*schedule, "train.steps=100"], [*schedule, "train.steps=40"], 40) == []


@pytest.mark.parametrize("kind", ["constant", "cosine"])
def test_below_the_step_reached_is_refused_even_when_accepted(kind):
    msg = refusal(
        [f"schedule.kind={kind}", "train.steps=100"],
        [f"schedule.kind={kind}", "train.steps=50", "train.accept_changes=[train.steps]"],
        90,
    )
    assert msg == (
        "train.steps: 50 is below step 90, which run/checkpoints/step_N has already trained "
        "(train.steps 100); give train.steps 90 or more, or use another output.dir"
    )


def test_the_steps_change_is_listed_with_the_other_refused_keys():
    msg = refusal(["train.steps=10"], ["train.steps=20", "train.seed=3"], 10)
    assert "train.seed 0 -> 3, train.steps 10 -> 20 moves" in msg
    assert "add train.accept_changes=[train.seed,train.steps]" in msg
    # an accepted schedule change: train.steps is judged on the new schedule alone
    msg = refusal(
        ["train.steps=10", "schedule.kind=constant"],
        ["train.steps=20", "schedule.kind=linear", "train.accept_changes=[schedule]"],
        10,
    )
    assert "train.accept_changes=[train.steps]" in msg
    assert "linear schedule: step 10 ran at 0.001, step 11 would run at 0.0005" in msg


# -- as the user sees it: `horizon train` on a run dir -------------------------------------------
@pytest.fixture(scope="module")
def cosine_run(tiny_store, tmp_path_factory):
    """A finished 2-step cosine run without warmup (checkpoint step_2) and its config."""
    tmp = tmp_path_factory.mktemp("cosine")
    data = write_jsonl(tmp / "chat.jsonl", chat_rows(16))
    cfg = write_config(
        tmp / "cfg.yaml",
        tiny_store,
        data,
        tmp / "run",
        train={"steps": 2},
        schedule={"kind": "cosine", "warmup_steps": 0},
    )
    r = horizon("train", cfg)
    assert r.exit_code == 0, r.output
    return tmp / "run", cfg


@pytest.fixture
def run(cosine_run, tmp_path):
    src, cfg = cosine_run
    shutil.copytree(src, tmp_path / "run")
    raw = yaml.safe_load(cfg.read_text())
    raw["output"]["dir"] = str(tmp_path / "run")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path / "run", tmp_path / "cfg.yaml"


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


def test_growing_a_cosine_run_dir_is_refused_and_changes_nothing(run):
    run_dir, cfg = run
    before = snapshot(run_dir)
    r = horizon("train", cfg, "train.steps=4")
    assert r.exit_code == 2 and "Traceback" not in r.output
    said = " ".join(r.output.split())
    assert said.startswith("error: output.dir: ") and said.count("error:") == 1
    ran = lr_at(1, lr=3e-3, total=2, kind="cosine")
    assert (
        f"train.steps 2 -> 4 moves the learning rate of the cosine schedule: step 2 ran at {ran:.3g}, "
        in said
    )
    assert "add train.accept_changes=[train.steps]" in said
    assert snapshot(run_dir) == before
    r = horizon("train", cfg, "train.steps=1")
    assert r.exit_code == 2 and "train.steps: 1 is below step 2, which" in " ".join(r.output.split())
    assert snapshot(run_dir) == before


def test_an_accepted_steps_change_runs_the_new_schedule_from_the_resume_step(run):
    run_dir, cfg = run
    r = horizon("train", cfg, "train.steps=4", "train.accept_changes=[train.steps]")
    assert r.exit_code == 0, r.output
    assert "note: resuming with a changed setting: train.steps 2 -> 4 moves the learning rate" in " ".join(
        r.output.split()
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lrs = {row["step"]: row["lr"] for row in rows}
    assert lrs[2] == lr_at(1, lr=3e-3, total=2, kind="cosine")  # as trained
    assert [lrs[3], lrs[4]] == [lr_at(k, lr=3e-3, total=4, kind="cosine") for k in (2, 3)]
