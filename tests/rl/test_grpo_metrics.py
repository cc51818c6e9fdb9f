"""TRL 1.16's GRPO metric names, on a short run: the terminated completions' min and max length,
the clip ratios at num_iterations 1 too (with their min / max over the completions), entropy,
num_tokens (counted when a batch is sampled, as TRL's num_input_tokens_seen), and a progress line
that says a reused batch of rollouts is reused (not 'rollout 0 tok/s'). Their values against TRL's
own _compute_loss: tests/rl/test_grpo_loss.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.conftest import horizon, write_config, write_jsonl


def test_grpo_metrics_follow_trls_names(tmp_path, tiny_store):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt_input_ids": [5 + i, 6, 7, 8]} for i in range(4)])
    rl = {"num_generations": 4, "max_completion_length": 6, "num_iterations": 2,
          "rewards": [{"function": "length", "target": 3}]}  # fmt: skip
    cfg = write_config(tmp_path / "c.yaml", tiny_store, data, tmp_path / "run", rl=rl,
                       train={"steps": 2, "batch_size": 2, "micro_batch_size": 4})  # fmt: skip
    r = horizon("train", cfg)
    assert r.exit_code == 0, r.output
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if "reward" in x and "step" in x]
    recs = [
        json.loads(ln) for ln in (tmp_path / "run" / "rollouts" / "step-1.jsonl").read_text().splitlines()
    ]
    term = [len(x["completion_ids"]) for x in recs if not x["truncated"]]
    assert [x["prompt"] for x in recs] == [x["prompt_ids"] for x in recs]  # the prompt as the record holds it
    first = steps[0]
    assert first["completions/min_terminated_length"] == (min(term) if term else 0)
    assert first["completions/max_terminated_length"] == (max(term) if term else 0)
    for row in steps:  # the first step of a group is ratio 1 (TRL logs the clip ratios at mu = 1 too)
        for k in ("low_mean", "high_mean", "region_mean"):
            assert f"clip_ratio/{k}" in row, k
    assert steps[0]["clip_ratio/region_mean"] == 0.0
    assert steps[0]["clip_ratio/low_min"] == steps[0]["clip_ratio/high_max"] == 0.0  # ratio 1
    for row in steps:  # a token-weighted mean lies between the least and the most completion's share
        assert row["clip_ratio/low_min"] <= row["clip_ratio/low_mean"]
        assert row["clip_ratio/high_mean"] <= row["clip_ratio/high_max"]
        assert row["entropy"] > 0
    seen = sum(len(x["prompt_ids"]) + len(x["completion_ids"]) for x in recs)
    assert steps[0]["num_tokens"] == steps[1]["num_tokens"] == seen  # step 2 reuses step 1's batch
    assert "rollout 0 tok/s" not in r.output


def test_every_grpo_metric_at_mu_1_has_the_clip_ratios(tmp_path, tiny_store):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt_input_ids": [5 + i, 6, 7, 8]} for i in range(4)])
    rl = {"num_generations": 2, "max_completion_length": 4, "rewards": [{"function": "length", "target": 3}]}
    cfg = write_config(tmp_path / "c.yaml", tiny_store, data, tmp_path / "run", rl=rl,
                       train={"steps": 1, "batch_size": 2, "micro_batch_size": 4})  # fmt: skip
    assert horizon("train", cfg).exit_code == 0
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(x for x in rows if "reward" in x)
    assert step["clip_ratio/low_mean"] == step["clip_ratio/high_mean"] == 0.0
    assert step["clip_ratio/low_min"] == step["clip_ratio/high_max"] == 0.0


@pytest.mark.parametrize(
    "values", [[float("nan")] * 4, [1.0, float("nan"), float("nan")], [1.0, 2.0, float("nan"), 4.0]]
)
def test_nanstd_equals_trls(values):
    """NaN where fewer than two values are given (TRL), not -0.0 (sqrt(0 / -1))."""
    from trl.trainer.utils import nanstd as trl_nanstd

    from horizon_cli.recipes.grpo.advantages import nanstd

    x = torch.tensor(values)
    got, want = nanstd(x), trl_nanstd(x)
    assert (math.isnan(got) and math.isnan(want)) or got.item() == pytest.approx(want.item(), rel=1e-6)
    assert not (got == 0 and math.copysign(1.0, float(got)) < 0)


def test_every_reward_none_is_nan_and_trls_warning(tmp_path, tiny_store):
    (tmp_path / "rw.py").write_text("def f(completions, **kw):\n    return [None] * len(completions)\n")
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt_input_ids": [5, 6, 7]}] * 4)
    rl = {
        "num_generations": 2,
        "max_completion_length": 4,
        "rewards": [{"function": f"{tmp_path / 'rw.py'}:f"}],
    }
    cfg = write_config(tmp_path / "c.yaml", tiny_store, data, tmp_path / "run", rl=rl,
                       train={"steps": 1, "batch_size": 2, "micro_batch_size": 4})  # fmt: skip
    r = horizon("train", cfg)
    assert r.exit_code == 0 and "All reward functions returned None" in r.output, r.output
    row = next(json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    assert row["reward"] is None and row["reward_std"] is None and row["rewards/f/std"] is None  # NaN: null
    assert row["frac_reward_zero_std"] == 0.0  # TRL: isclose(NaN, 0) is false


def test_tokens_seen_is_read_back_from_the_step_row_or_counted_from_the_rollouts(tmp_path):
    """num_tokens on resume: the resumed step's metrics row; a run logged before the metric: its
    rollouts/step-N.jsonl files up to that step (prompt + completion tokens)."""
    from horizon_cli.recipes.grpo.seen import tokens_seen

    (tmp_path / "rollouts").mkdir()
    for n, lines in ((1, [([1, 2], [3]), ([1, 2], [4, 5])]), (3, [([7], [8, 9, 10])]), (5, [([1], [1])])):
        text = "".join(json.dumps({"prompt_ids": p, "completion_ids": c}) + "\n" for p, c in lines)
        (tmp_path / "rollouts" / f"step-{n}.jsonl").write_text(text)
    (tmp_path / "rollouts" / "eval-step-4.jsonl").write_text(json.dumps({"prompt_ids": [1] * 50}) + "\n")
    assert tokens_seen(tmp_path, 4) == (3 + 4) + 4  # steps 1 and 3 sampled; 5 is after, eval never counts
    tool = {"prompt_ids": [1], "completion_ids": [2, 3, 4, 5], "tool_mask": [1, 0, 0, 1]}
    (tmp_path / "rollouts" / "step-2.jsonl").write_text(json.dumps(tool) + "\n")
    assert tokens_seen(tmp_path, 4) == (3 + 4) + 4 + (1 + 2)  # with tools: the sampled ids only
    rows = [{"step": 3, "num_tokens": 11}, {"step": 4, "num_tokens": 99}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "num')
    assert tokens_seen(tmp_path, 4) == 99  # the row of the step resumed from (a garbled tail skipped)
