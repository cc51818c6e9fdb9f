"""GRPO under torchrun: 2 ranks train what 1 trains. Each rank samples its part of the prompts
(a group whole on one rank, rows seeded by their place in the step's batch) in lock step with
the other, the rollouts and rewards are gathered, so the rollout files, the advantages
(scale_rewards: batch, the batch's std over both ranks), TRL's metrics (train and eval, whose
batch is split unevenly), the losses and the exported weights equal one process's (fp32)."""

from __future__ import annotations

import pytest
import torch
from conftest import write_config, write_jsonl
from test_dist import torchrun
from test_grpo_train import REWARD, _prompts
from test_pref_train import quiet

from horizon_cli.train.metrics import read_metrics

KEYS = (
    "loss",
    "grad_norm",
    "tokens",
    "reward",
    "reward_std",
    "rewards/low_ids/mean",
    "rewards/length/mean",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "kl",
    "clip_ratio/region_mean",
    "eval_loss",
    "eval_reward",
    "eval_reward_std",
    "eval_completions/mean_length",
    "eval_kl",
)


def _configs(tmp_path, tiny_store, rl: dict, **train) -> dict:
    data = write_jsonl(tmp_path / "p.jsonl", _prompts(14))
    (tmp_path / "rw.py").write_text(REWARD)
    rl = {"num_generations": 3, "max_completion_length": 6,
          "rewards": [{"function": f"{tmp_path / 'rw.py'}:low_ids"}, {"function": "length", "target": 3, "weight": 0.5}],
          **rl}  # fmt: skip
    sections = dict(
        train={"steps": 3, "batch_size": 4, "micro_batch_size": 3, "seed": 3, "eval_every": 3, **train},
        data={"eval_fraction": 0.2},
        engine={"compute_threads": 1},
        schedule={"kind": "constant", "warmup_steps": 0},
        output={"save_every": 0, "export": True},
        rl=rl,
    )
    return {
        n: write_config(tmp_path / f"{n}.yaml", tiny_store, data, tmp_path / n, **sections) for n in ("one", "two")
    }


def _same_runs(tmp_path, steps: int) -> None:
    from safetensors.torch import load_file

    a, b = (read_metrics(tmp_path / n / "metrics.jsonl") for n in ("one", "two"))
    assert len(a) == len(b) == steps
    assert a[-1].get("eval_reward") is not None
    for x, y in zip(a, b, strict=True):
        for k in KEYS:
            assert (x.get(k) is None) == (y.get(k) is None), k
            if x.get(k) is not None:
                assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), k
    for s in range(1, steps + 1):
        fa, fb = (tmp_path / n / "rollouts" / f"step-{s}.jsonl" for n in ("one", "two"))
        if fa.is_file() or fb.is_file():
            la, lb = fa.read_text().splitlines(), fb.read_text().splitlines()
            assert len(la) == len(lb)
            for u, v in zip(la, lb, strict=True):
                assert u == v or _close_lines(u, v), s
    ea, eb = (load_file(str(next((tmp_path / n / "export").glob("*.safetensors")))) for n in ("one", "two"))
    assert ea.keys() == eb.keys()
    for k in ea:
        assert torch.allclose(ea[k], eb[k], rtol=1e-5, atol=1e-6), k


def _close_lines(u: str, v: str) -> bool:
    """The same completion, its floats (advantage) within fp32 rounding."""
    import json

    x, y = json.loads(u), json.loads(v)
    if {k: x[k] for k in x if k != "advantage"} != {k: y[k] for k in y if k != "advantage"}:
        return False
    return x["advantage"] == pytest.approx(y["advantage"], rel=1e-6, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "rl",
    [
        dict(beta=0.04, num_iterations=2, scale_rewards="batch", loss_type="grpo", epsilon=0.05),
        dict(loss_type="dr_grpo", temperature=0.8),
    ],
    ids=["grpo-beta-mu2-batch", "dr_grpo"],
)
def test_two_ranks_train_what_one_trains(tmp_path, tiny_store, rl):
    cfgs = _configs(tmp_path, tiny_store, rl)
    quiet(cfgs["one"])
    r = torchrun(2, cfgs["two"])
    assert r.returncode == 0, r.stderr
    _same_runs(tmp_path, 3)
