"""TRL 1.16's reward interface, all of it (GRPOTrainer._calculate_rewards): `async def` functions
awaited together; `trainer_state` a transformers TrainerState with TRL's fields; `log_metric` and
`log_extra`; a reward file's own folder importable; `rl.scale_rewards: true/false` as GRPOConfig
maps them; a reward model (`{model: PATH}`) refused in one line."""

from __future__ import annotations

import json
import math

import pytest

from horizon_cli.config import load_config
from horizon_cli.recipes.grpo.rewards import Reward, load_rewards, score
from tests.conftest import horizon, write_config, write_jsonl

ASYNC = """
import asyncio
from t4_calls import CALLS  # a module beside the file: one list for both functions

async def slow_a(completions, **kw):
    CALLS.append(("a", "start"))
    await asyncio.sleep(0.05)
    CALLS.append(("a", "end"))
    return [1.0] * len(completions)

async def slow_b(completions, **kw):
    CALLS.append(("b", "start"))
    await asyncio.sleep(0.05)
    CALLS.append(("b", "end"))
    return [None if c == "none" else 2.0 for c in completions]
"""


def _score(rewards, completions, state=None, **kw):
    return score(rewards, ["p"] * len(completions), completions, [[1]] * len(completions), {}, 0,
                 lambda k: f"completion {k}", state=state, **kw)  # fmt: skip


def test_async_rewards_are_awaited_together(tmp_path, monkeypatch):
    (tmp_path / "rw.py").write_text(ASYNC)
    (tmp_path / "t4_calls.py").write_text("CALLS = []\n")
    monkeypatch.chdir(tmp_path)
    from horizon_cli.config.schema import RewardConfig

    rs = load_rewards([RewardConfig(function="rw.py:slow_a"), RewardConfig(function="rw.py:slow_b")])
    vals = _score(rs, ["x", "none"])
    assert vals[0] == [1.0, 1.0] and vals[1][0] == 2.0 and math.isnan(vals[1][1])
    calls = rs[0].fn.__globals__["CALLS"]
    assert calls[:2] == [("a", "start"), ("b", "start")]  # both started before either ended (gathered)


def test_trainer_state_has_trls_fields_and_log_metric_and_log_extra_reach_the_caller():
    seen = {}

    def f(completions, trainer_state, log_metric, log_extra, **kw):
        seen["state"] = trainer_state
        log_metric("my/metric", 0.5)
        log_extra("my_column", [len(c) for c in completions])
        return [1.0] * len(completions)

    from transformers import TrainerState

    state = TrainerState(global_step=3, max_steps=10, epoch=1.5, num_train_epochs=4)
    logs: dict = {}
    _score([Reward("f", 1.0, f, "rl.rewards[0]")], ["ab", "c"], state=state, logs=logs)
    st = seen["state"]
    assert isinstance(st, TrainerState) and (st.global_step, st.max_steps, st.epoch) == (3, 10, 1.5)
    assert logs == {"metrics": {"my/metric": [0.5]}, "extra": {"my_column": [2, 1]}}


def test_a_reward_files_own_folder_is_importable(tmp_path, monkeypatch):
    d = tmp_path / "rewards"
    d.mkdir()
    (d / "helper_t4.py").write_text("def score(c):\n    return 0.25 * len(c)\n")
    (d / "rw.py").write_text(
        "from helper_t4 import score\n\ndef f(completions, **kw):\n    return [score(c) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    from horizon_cli.config.schema import RewardConfig

    (r,) = load_rewards([RewardConfig(function="rewards/rw.py:f")])
    assert _score([r], ["abcd"]) == [[1.0]]


@pytest.mark.parametrize("given, want", [(True, "group"), (False, "none"), ("batch", "batch")])
def test_scale_rewards_true_and_false_as_grpoconfig_maps_them(tmp_path, tiny_store, given, want):
    from trl import GRPOConfig

    assert (
        GRPOConfig(output_dir=str(tmp_path), scale_rewards=given, use_cpu=True, bf16=False).scale_rewards
        == want
    )
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a b"}] * 4)
    cfg = write_config(tmp_path / "c.yaml", tiny_store, data, tmp_path / "run",
                       rl={"scale_rewards": given, "rewards": [{"function": "length", "target": 4}]})  # fmt: skip
    assert load_config(cfg).rl.scale_rewards == want


@pytest.mark.parametrize(
    "reward, said",
    [
        ({}, "rl.rewards[0].model: {store} is a causal LM's store, not a reward model's"),
        (
            {"function": "length", "target": 3},
            "rl.rewards[0].function: a reward model takes none (it has model:)",
        ),
    ],
    ids=["a-causal-lm", "beside-a-function"],
)
def test_a_reward_model_that_is_not_one_is_refused_in_one_line(tmp_path, tiny_store, reward, said):
    """(A reward model that is one: tests/rl/test_reward_model.py.)"""
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a b"}] * 4)
    cfg = write_config(tmp_path / "c.yaml", tiny_store, data, tmp_path / "run",
                       rl={"max_completion_length": 8, "rewards": [{"model": str(tiny_store), **reward}]})  # fmt: skip
    r = horizon("train", cfg)
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert said.format(store=tiny_store) in lines[0]
    assert not (tmp_path / "run").exists()


def test_log_metric_and_log_extra_reach_the_metrics_and_the_rollouts(tmp_path, tiny_store):
    (tmp_path / "rw.py").write_text(
        "def f(completions, log_metric, log_extra, trainer_state, **kw):\n"
        "    log_metric('custom/x', trainer_state.global_step + 0.5)\n"
        "    log_extra('n_chars', [len(c) for c in completions])\n"
        "    return [float(len(c) % 3) for c in completions]\n"
    )
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt_input_ids": [5, 6, 7, 8]}] * 4)
    cfg = write_config(tmp_path / "c.yaml", tiny_store, data, tmp_path / "run",
                       rl={"num_generations": 2, "max_completion_length": 4,
                           "rewards": [{"function": f"{tmp_path / 'rw.py'}:f"}]},
                       train={"steps": 2, "batch_size": 2, "micro_batch_size": 2})  # fmt: skip
    r = horizon("train", cfg)
    assert r.exit_code == 0, r.output
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if "custom/x" in x]
    assert [x["custom/x"] for x in steps] == [0.5, 1.5]
    recs = [
        json.loads(ln) for ln in (tmp_path / "run" / "rollouts" / "step-1.jsonl").read_text().splitlines()
    ]
    assert all(rec["n_chars"] == len(rec.get("completion", "")) for rec in recs)


def test_train_seed_seeds_what_rewards_draw_from(tmp_path, tiny_store):
    """train.seed seeds Python's, numpy's and torch's global generators at a fresh start, as TRL's
    Trainer does (set_seed): two runs of one config reward alike; a checkpoint carries all three."""
    import random

    import numpy as np
    import torch

    from horizon_cli.train.checkpoint import _rng_state, _set_rng_state

    (tmp_path / "rw.py").write_text(
        "import random\nimport numpy as np\nimport torch\n"
        "def f(completions, **kw):\n"
        "    return [random.random() + float(np.random.rand()) + float(torch.rand(())) for _ in completions]\n"
    )
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt_input_ids": [5, 6, 7, 8]}] * 4)
    got = []
    for run in ("a", "b"):
        random.seed(len(run) * 7 + ord(run))  # whatever the process drew before: the run seeds them
        cfg = write_config(tmp_path / f"{run}.yaml", tiny_store, data, tmp_path / run,
                           rl={"num_generations": 2, "max_completion_length": 4,
                               "rewards": [{"function": f"{tmp_path / 'rw.py'}:f"}]},
                           train={"steps": 1, "batch_size": 2, "micro_batch_size": 2, "seed": 3})  # fmt: skip
        assert horizon("train", cfg).exit_code == 0
        lines = (tmp_path / run / "rollouts" / "step-1.jsonl").read_text().splitlines()
        got.append([json.loads(ln)["rewards"]["f"] for ln in lines])
    assert got[0] == got[1] and len(set(got[0])) == len(got[0])
    state = json.loads(json.dumps(_rng_state()))  # as trainer.json holds it
    want = (random.random(), float(np.random.rand()), float(torch.rand(())))
    _set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == want
