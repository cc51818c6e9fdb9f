"""`horizon train` with a preference: section: bad input in one line (exit 2); the reference kept in
the run dir, reused on resume and never rebuilt from a checkpoint; a resumed run bitwise equal to an
uninterrupted one (in process; SIGKILLed, slow); the section part of the trajectory; two ranks
equal to one (slow)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

import horizon_cli.recipes.preference.reference as reference
from horizon_cli.errors import InputError
from horizon_cli.train import run_training
from horizon_cli.train.metrics import read_metrics
from tests.conftest import chat_rows, write_config, write_jsonl
from tests.train.test_train_cli import horizon, one_error_line

PREF = {"loss": "dpo", "beta": 0.5}


def pair_rows(n: int = 24, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"what is {a} plus {b}?"}],
                "chosen": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}],
                "rejected": [{"role": "assistant", "content": f"{a * b + 1}"}],
            }
        )
    return rows


@pytest.fixture
def make(tiny_store, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows())

    def cfg(name="run", data_path=data, **sections):
        sections.setdefault("preference", PREF)
        sections = {k: v for k, v in sections.items() if v is not None}
        return write_config(tmp_path / f"{name}.yaml", tiny_store, data_path, tmp_path / name, **sections)

    return cfg


def quiet(cfg, *over):
    threads = torch.get_num_threads()  # engine.compute_threads sets torch's for the process
    try:
        return run_training(cfg, list(over), console=Console(quiet=True))
    finally:
        torch.set_num_threads(threads)


def test_bad_preference_input_is_one_line(make, tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    msg = one_error_line(horizon("train", make(data_path=chat)))
    assert "preference.loss: dpo trains on preference pairs" in msg and "format chat" in msg
    assert (
        one_error_line(horizon("train", make(data_path=chat), "--dry-run")) == msg
    )  # train/checks.py's order
    msg = one_error_line(horizon("train", make(preference=None)))
    assert "holds preference pairs (format preference); add a preference: section" in msg
    assert one_error_line(horizon("train", make(preference=None), "--dry-run")) == msg
    assert "preference.beta: 0.0 must be greater than 0.0" in one_error_line(
        horizon("train", make(), "preference.beta=0")
    )
    assert "data.packing: preference pairs are not packed" in one_error_line(
        horizon("train", make(), "data.packing=true")
    )
    assert "only cdpo and simpo use it, not orpo" in one_error_line(
        horizon("train", make(), "preference.loss=orpo", "preference.label_smoothing=0.1")
    )
    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "a", "chosen": " b"}])
    assert "has field 'chosen' but no 'rejected'" in one_error_line(horizon("train", make(data_path=one)))
    half = write_jsonl(
        tmp_path / "half.jsonl",
        [{"prompt": "a", "chosen": " b", "rejected": " c"}, {"prompt": "d", "chosen": " e"}],
    )
    assert "half.jsonl: record 2: has no 'rejected'" in one_error_line(horizon("train", make(data_path=half)))


@pytest.mark.parametrize(
    "over, said",
    [
        (["data.train_on_prompt=true"], "data.train_on_prompt: preference.loss dpo compares the pair's completions"),
        (["preference.simpo_gamma=1.0"], "preference.simpo_gamma: only simpo uses it, not dpo"),
        (["preference.loss=orpo", "preference.simpo_gamma=0.2"], "preference.simpo_gamma: only simpo uses it, not orpo"),
        (["preference.label_smoothing=0.2"], "loss dpo is TRL 1.16's DPOTrainer loss_type sigmoid, which ignores"),
        (["preference.loss=ipo", "preference.label_smoothing=0.2"], "only cdpo and simpo use it, not ipo"),
    ],
)  # fmt: skip
def test_a_setting_the_run_would_not_use_is_refused(make, over, said):
    """Issue 32: these were silently ignored (the same gradients as without them)."""
    assert said in one_error_line(horizon("train", make(), *over))


def test_a_dumped_config_with_every_key_at_its_default_loads(make, tmp_path):
    """A run's config.yaml states every key (simpo_gamma 0.5, train_on_prompt false): not "set"."""
    from horizon_cli.config import dump_yaml, load_config

    for loss in ("dpo", "cdpo", "ipo", "simpo", "orpo"):
        cfg = load_config(make(), [f"preference.loss={loss}"])
        again = tmp_path / f"dumped-{loss}.yaml"
        again.write_text(dump_yaml(cfg))
        assert load_config(again) == cfg
    assert (
        load_config(make(), ["preference.loss=cdpo", "preference.label_smoothing=0.2"]).preference.loss
        == "cdpo"
    )


def test_reference_is_kept_reused_and_never_rebuilt_from_a_checkpoint(make, tmp_path, monkeypatch):
    sections = dict(train={"steps": 2}, output={"save_every": 1, "export": False})
    whole = make("whole", **sections)
    quiet(whole)
    cut = make("cut", **sections)
    quiet(cut, "train.steps=1")
    ref = tmp_path / "cut" / "reference"
    meta = json.loads((ref / "meta.json").read_text())
    assert meta["pairs"].keys() == {"train"} and meta["files"]["train"]["shape"] == [24, 2]
    before = (ref / "train.npy").stat().st_mtime_ns

    def never(*a, **k):
        raise AssertionError("the reference was recomputed on resume")

    monkeypatch.setattr(reference, "compute", never)
    quiet(cut)  # resumes at step 1: reads the reference back
    assert (ref / "train.npy").stat().st_mtime_ns == before
    a, b = (read_metrics(tmp_path / n / "metrics.jsonl") for n in ("whole", "cut"))
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 2
    assert [r["rewards_accuracy"] for r in a] == [r["rewards_accuracy"] for r in b]
    ca, cb = (tmp_path / n / "checkpoints" / "step_2" for n in ("whole", "cut"))
    files = [f.relative_to(ca) for f in ca.rglob("*.bin")]
    assert any(f.parts[0] == "units" for f in files) and any(f.name.endswith(".m.bin") for f in files)
    for f in files:  # weights and AdamW moments, bit for bit
        assert (ca / f).read_bytes() == (cb / f).read_bytes(), f
    raw = bytearray((ref / "train.npy").read_bytes())
    raw[-1] ^= 1
    (ref / "train.npy").write_bytes(bytes(raw))
    with pytest.raises(InputError, match=r"fails its checksum.*cannot rebuild it"):
        quiet(cut, "train.steps=3")
    with pytest.raises(InputError, match=r"preference.beta 0.5 -> 0.25"):
        quiet(cut, "train.steps=3", "preference.beta=0.25")


def test_metrics_are_means_over_the_pairs(make, tmp_path):
    cfg = make(train={"steps": 2, "eval_every": 2}, data={"eval_fraction": 0.25})
    quiet(cfg)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    for r in rows:
        assert r["pairs"] == 4 and 0.0 <= r["rewards_accuracy"] <= 1.0
        assert r["rewards_margin"] == pytest.approx(r["rewards_chosen"] - r["rewards_rejected"], abs=1e-6)
    assert rows[0]["rewards_margin"] == 0.0  # step 1: the policy is the reference
    assert rows[-1]["eval_rewards_accuracy"] is not None and rows[-1]["eval_loss"] > 0


def test_the_cli_trains_dpo_by_epochs_of_pairs_with_eval_time_samples(make, tmp_path):
    """horizon train end to end: train.epochs counts pairs (after the eval split), evaluations
    report the pair metrics, train.samples answers its prompts at each evaluation."""
    ask = write_jsonl(tmp_path / "ask.jsonl", [{"prompt": "what is 2 plus 3?"}])
    train = {"steps": None, "epochs": 0.5, "eval_every": 1, "samples": str(ask), "sample_tokens": 3}
    r = horizon("train", make(train=train, data={"eval_fraction": 0.25}))
    assert r.exit_code == 0, r.output
    assert "train.epochs 0.5 of 18 pairs at train.batch_size 4 = train.steps 3" in r.output  # ceil(9 / 4)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [x["step"] for x in rows] == [1, 2, 3] and all(
        x["eval_rewards_accuracy"] is not None for x in rows
    )
    answers = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [a["step"] for a in answers] == [1, 2, 3] and all(len(a["completion_ids"]) <= 3 for a in answers)


def test_a_dpo_run_keeping_layers_trains_what_recomputing_trains(make, tmp_path):
    """engine.keep_activations under the pair objective: the kept graph is the one recompute
    builds, so every metric of every step is the same, bit for bit (fp32, one process)."""
    for keep in (0, 2):
        quiet(make(f"keep{keep}", train={"steps": 2}, engine={"keep_activations": keep}))
    a, b = (read_metrics(tmp_path / f"keep{k}" / "metrics.jsonl") for k in (0, 2))
    assert [r["kept_layers"] for r in a] == [0, 0] and [r["kept_layers"] for r in b] == [2, 2]
    for k in ("loss", "grad_norm", "rewards_margin", "logps_chosen", "logps_rejected"):
        assert [r[k] for r in a] == [r[k] for r in b], k


def test_llama70b_dpo_plans_as_sft_on_one_h200_and_1_5_tb():
    """A pair is two sequences: 32 pairs plan as the SFT config's 64 sequences, and fit."""
    from horizon_cli.arch import spec_from_hf
    from horizon_cli.config import load_config
    from horizon_cli.planning.ladder import plan_for
    from tests.config.test_configs import LLAMA_31_70B

    configs = Path(__file__).resolve().parents[2] / "configs"
    dpo, sft = (load_config(configs / f"llama70b-{n}.yaml") for n in ("dpo", "sft"))
    spec = spec_from_hf(LLAMA_31_70B)
    plan, same = plan_for(dpo, spec, "exact"), plan_for(sft, spec, "exact")
    assert dpo.preference is not None and dpo.train.batch_size * 2 == sft.train.batch_size
    assert plan.host == same.host and plan.device == same.device
    assert plan.host_total < 1.5e12 * 0.8 and plan.device_total < 141e9 * 0.5


@pytest.mark.slow
def test_sigkilled_dpo_run_resumes_bitwise_identical(make, tmp_path):
    sections = dict(
        train={"steps": 6},
        engine={"compute_threads": 1},
        output={"save_every": 2, "export": True, "keep_last": 1},
    )  # one thread in both runs: the same float reductions
    quiet(make("whole", **sections))
    cfg = make("killed", **sections)
    cmd = [sys.executable, "-m", "horizon_cli.cli", "train", str(cfg)]
    env = {"HORIZON_FAULT": "after-step:3", "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    resumed = subprocess.run(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "reused" in resumed.stdout
    a, b = (read_metrics(tmp_path / n / "metrics.jsonl") for n in ("whole", "killed"))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    ea, eb = (
        load_file(str(next((tmp_path / n / "export").glob("*.safetensors")))) for n in ("whole", "killed")
    )
    assert all(torch.equal(ea[k], eb[k]) for k in ea)


@pytest.mark.slow
def test_two_ranks_train_what_one_trains(make, tmp_path):
    from tests.parallel.test_dist import torchrun

    sections = dict(
        # 5 eval pairs in batches of 4 and 1: the second deals one micro-batch to two ranks
        train={"steps": 4, "batch_size": 4, "micro_batch_size": 1, "eval_every": 4, "eval_batches": 2},
        data={"eval_fraction": 0.2},
        engine={"compute_threads": 1},
        output={"save_every": 0, "export": True},
    )
    quiet(make("one", **sections))
    r = torchrun(2, make("two", **sections))
    assert r.returncode == 0, r.stderr
    a, b = (read_metrics(tmp_path / n / "metrics.jsonl") for n in ("one", "two"))
    assert a[-1]["eval_rewards_margin"] is not None
    for x, y in zip(a, b, strict=True):
        for k in (
            "loss",
            "rewards_accuracy",
            "rewards_margin",
            "logps_chosen",
            "eval_loss",
            "eval_rewards_margin",
        ):
            assert (x.get(k) is None) == (y.get(k) is None), k
            if x.get(k) is not None:
                assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), k
    ea, eb = (load_file(str(next((tmp_path / n / "export").glob("*.safetensors")))) for n in ("one", "two"))
    for k in ea:
        assert torch.allclose(ea[k], eb[k], rtol=1e-5, atol=1e-6), k
