"""Crash safety of an `rl:` run: SIGKILLed while a step's rollout is being generated (the fault
point `rollout:N`, marked at every decode sweep of step N's sampling: horizon_cli/faults.py), the
run started again resumes from its last checkpoint and ends bitwise equal to an uninterrupted run:
the final checkpoint's files, every rollouts/step-N.jsonl, and every metric that is not a time or
a memory reading. With num_iterations 2 the kill lands in the first step of a group of two, whose
rollouts (and rollouts/step-N.pt) the resumed run samples again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from horizon_cli.train.metrics import read_metrics
from tests.conftest import write_config, write_jsonl
from tests.rl.test_grpo_train import REWARD, _prompts
from tests.train.test_train_resume import marks, train

VOLATILE = ("_s", "per_s", "_bytes", "_rss")  # times, speeds and memory readings differ run to run


def config(tmp: Path, store: Path, rl: dict) -> Path:
    tmp.mkdir()
    data = write_jsonl(tmp / "p.jsonl", _prompts())
    (tmp / "rw.py").write_text(REWARD)
    rl = {"num_generations": 4, "max_completion_length": 8,
          "rewards": [{"function": f"{tmp / 'rw.py'}:low_ids"}, {"function": "length", "target": 5}], **rl}  # fmt: skip
    return write_config(tmp / "c.yaml", store, data, tmp / "run", rl=rl,
                        train={"steps": 4, "batch_size": 2, "micro_batch_size": 3, "seed": 2},
                        schedule={"kind": "constant", "warmup_steps": 0},
                        output={"save_every": 2, "keep_last": 1, "export": False})  # fmt: skip


def outcome(run: Path) -> dict:
    ck = run / "checkpoints" / "step_4"
    skip = {"state/config.yaml", "checksums.json"}  # name the run dir
    files = {f"ck/{p.relative_to(ck)}": p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    files = {k: v for k, v in files.items() if k[3:] not in skip}
    trainer = json.loads(files.pop("ck/state/trainer.json"))
    trainer.pop("rng")  # a fresh process starts from an unseeded RNG state that training never uses
    files["ck/state/trainer.json"] = json.dumps(trainer, sort_keys=True).encode()
    # rollouts/step-N.pt (num_iterations > 1) also pickles the step's rollout times: not compared
    # bytewise; what a resumed group reads from it shows in its steps' metrics and weights
    files |= {f"rollouts/{p.name}": p.read_bytes() for p in (run / "rollouts").glob("*.jsonl")}
    rows = [
        {k: v for k, v in r.items() if not k.endswith(VOLATILE)} for r in read_metrics(run / "metrics.jsonl")
    ]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and any(k.endswith(".bin") for k in files)
    return {"files": files, "metrics": rows}


def uninterrupted(cfg: Path) -> None:
    """In this process (one process start fewer), on one thread as the killed runs are."""
    import torch
    from rich.console import Console

    from horizon_cli.train import run_training

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_training(cfg, [], console=Console(quiet=True))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "rl, fault",
    [
        pytest.param({"beta": 0.04}, "rollout:3", id="beta-mu1"),  # step 3's first decode sweep
        pytest.param(  # 4 ms after it: a few sweeps on (a landing that varies)
            {"num_iterations": 2}, "rollout:3+4", marks=pytest.mark.slow, id="mu2-delayed"
        ),
    ],
)
def test_killed_mid_rollout_resumes_bitwise_identical(tiny_store, tmp_path, rl, fault):
    whole = config(tmp_path / "whole", tiny_store, rl)
    uninterrupted(whole)
    cut = config(tmp_path / "cut", tiny_store, rl)
    phases = tmp_path / "phases"
    killed = train(cut, fault, phases)
    assert killed.returncode == -9, killed.stderr  # SIGKILL
    sweeps = [x for x in marks(phases) if x[:2] == ("rollout", "3")]
    assert marks(phases)[-1][:2] == ("rollout", "3")  # no later mark: not past step 3
    run = cut.parent / "run"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_2"]
    if "+" not in fault:  # at the first decode sweep (after the prefill's): nothing of step 3 written
        assert len(sweeps) == 1 and not (run / "rollouts" / "step-3.jsonl").exists()
    resumed = train(cut)
    assert resumed.returncode == 0, resumed.stderr
    assert "(step2)" in "".join(resumed.stdout.split())  # rich wraps long lines
    assert outcome(run) == outcome(whole.parent / "run")
