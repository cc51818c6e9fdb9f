"""GRPO under torchrun: 2 ranks train what 1 trains. Each rank samples its part of the prompts
(a group whole on one rank, rows seeded by their place in the step's batch) in lock step with
the other, the rollouts and rewards are gathered, so the rollout files, the advantages
(scale_rewards: batch, the batch's std over both ranks), TRL's metrics (train and eval, whose
batch is split unevenly; the clip ratios' min / max over both ranks' completions), the eval
rollouts, the losses and the exported weights equal one process's (fp32)."""

from __future__ import annotations

import pytest
import torch

from horizon_cli.train.metrics import read_metrics
from tests.conftest import write_config, write_jsonl
from tests.parallel.test_dist import torchrun
from tests.preference.test_pref_train import quiet
from tests.rl.test_grpo_train import REWARD, _prompts

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
    "clip_ratio/low_min",  # the least over every rank's completions (engine.stats MIN)
    "clip_ratio/high_max",
    "entropy",
    "num_tokens",
    "eval_loss",
    "eval_reward",
    "eval_reward_std",
    "eval_completions/mean_length",
    "eval_kl",
    "eval_entropy",
    "eval_num_tokens",
    "eval_clip_ratio/region_mean",
)


def _configs(tmp_path, tiny_store, rl: dict, held: float = 0.2, **train) -> dict:
    data = write_jsonl(tmp_path / "p.jsonl", _prompts(14))
    (tmp_path / "rw.py").write_text(REWARD)
    rl = {"num_generations": 3, "max_completion_length": 6,
          "rewards": [{"function": f"{tmp_path / 'rw.py'}:low_ids"}, {"function": "length", "target": 3, "weight": 0.5}],
          **rl}  # fmt: skip
    sections = dict(
        train={"steps": 3, "batch_size": 4, "micro_batch_size": 3, "seed": 3, "eval_every": 3, **train},
        data={"eval_fraction": held},  # 0.2: 3 of the 14 prompts held out; 0.1: 1
        engine={"compute_threads": 1},
        schedule={"kind": "constant", "warmup_steps": 0},
        output={"save_every": 0, "export": True},
        rl=rl,
    )
    return {
        n: write_config(tmp_path / f"{n}.yaml", tiny_store, data, tmp_path / n, **sections)
        for n in ("one", "two")
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
    names = [f"step-{s}" for s in range(1, steps + 1)] + [f"eval-step-{steps}"]
    assert all((tmp_path / n / "rollouts" / f"eval-step-{steps}.jsonl").is_file() for n in ("one", "two"))
    for s in names:
        fa, fb = (tmp_path / n / "rollouts" / f"{s}.jsonl" for n in ("one", "two"))
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
    "rl, held",
    [
        (dict(beta=0.04, num_iterations=2, scale_rewards="batch", loss_type="grpo", epsilon=0.05), 0.2),
        (dict(loss_type="dr_grpo", temperature=0.8), 0.1),
    ],
    ids=["grpo-beta-mu2-batch", "dr_grpo"],
)
def test_two_ranks_train_what_one_trains(tmp_path, tiny_store, rl, held):
    """The eval batch: 3 prompts split 1 / 2 over the ranks, or 1 prompt, rank 0 sweeping a copy.
    num_iterations 2: the 2-rank run stops after step 1 and is resumed inside its group of steps
    (the group's rollouts read back from rank 0's step-1.pt), against one uninterrupted process."""
    cfgs = _configs(tmp_path, tiny_store, rl, held)
    quiet(cfgs["one"])
    if rl.get("num_iterations", 1) > 1:
        r = torchrun(2, cfgs["two"], "train.steps=1")
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "two" / "rollouts" / "step-1.pt").is_file()
    r = torchrun(2, cfgs["two"])
    assert r.returncode == 0, r.stderr
    _same_runs(tmp_path, 3)


def test_a_rank_whose_rows_have_stopped_sweeps_along_until_no_rank_has_one(tiny_store, monkeypatch):
    """The lock step without torchrun: a stand-in second rank (Generation.across) whose longest
    limit is 9 and whose rows go on for 7 decode sweeps. This rank's rows stop after 4 tokens and
    its last micro-batch then sweeps along (a sweep each time the other rank has a live row), in
    KV caches opened for the other rank's limit; its completions are the ones it gives alone."""
    from horizon_cli.config.schema import EngineConfig, OptimConfig
    from horizon_cli.engine import Engine
    from horizon_cli.generate.decode import Generation
    from horizon_cli.generate.decoder import Decoder
    from horizon_cli.model.sample import Sampler
    from horizon_cli.store import Store

    rows = [(k, p["prompt_input_ids"][: 3 + k]) for k, p in enumerate(_prompts(3))]
    eng = Engine(Store.open(tiny_store), EngineConfig(device="cpu", dtype="float32"), OptimConfig(),
                 forward_only=True)  # fmt: skip
    calls: list[int] = []
    sized: list[int] = []  # the new positions each KV cache is opened for (host mode: its buffers)

    def across(self, n: int) -> list[int]:
        calls.append(n)
        return [n, 9 if len(calls) == 1 else int(len(calls) <= 8)]

    def run() -> tuple[list, int]:
        sweeps: list = []
        dec = Decoder(eng, Sampler(1.0, 1.0, 0, 5), max_new_tokens=4, on_sweep=sweeps.append)
        return [(c.index, c.ids, c.finish) for c in dec.run(rows)], len(sweeps)

    try:
        alone, n_alone = run()
        monkeypatch.setattr(Generation, "across", across)
        opened = Generation.open
        monkeypatch.setattr(
            Generation, "open", lambda self, dbs, new, host: sized.append(new) or opened(self, dbs, new, host)
        )
        along, n_along = run()
    finally:
        eng.close()
    assert n_alone == 4 and all(len(ids) == 4 for _, ids, _ in alone)
    assert along == alone
    assert sized == [9]
    assert n_along == 1 + 7  # the prefill, then a sweep for each of the other rank's live counts
    assert calls[1:] == [1, 1, 1] + [0] * 5  # this rank's live micro-batches after each sweep


def test_the_world_check_counts_completions_and_the_dry_run_plans_one_rank(tmp_path, tiny_store):
    """Under --world-size an rl run's batch_size x G completions must make micro-batches that split
    over the ranks (one line, exit 2 otherwise); the rollout plan is one rank's part."""
    import json

    from tests.conftest import horizon
    from tests.train.test_train_cli import one_error_line

    cfgs = _configs(tmp_path, tiny_store, {}, micro_batch_size=4)  # 12 completions: 3 micro-batches
    msg = one_error_line(horizon("train", cfgs["one"], "--dry-run", "--world-size", "2"))
    assert "train.micro_batch_size: the 12 completions of a step" in msg and "over 2 ranks" in msg
    out = tmp_path / "plan.json"
    r = horizon(
        "train", cfgs["one"], "train.micro_batch_size=3", "--dry-run", "--world-size", "2", "--json", out
    )
    assert r.exit_code == 0, r.output
    assert "each of 2 ranks decoding at most 6 of them" in r.output
    roll = json.loads(out.read_text())["rollouts"]
    assert (roll["rows"], roll["rank_rows"], roll["world"]) == (12, 6, 2)


@pytest.mark.slow
def test_a_reward_error_on_one_rank_stops_every_rank_with_its_line(tmp_path, tiny_store):
    """Rank 1's reward function raises, rank 0's does not: after the gather every rank stops with
    rank 1's one line (exit 2), none waiting in a collective for the other."""
    cfgs = _configs(tmp_path, tiny_store, {})
    (tmp_path / "rw.py").write_text(
        "import os\n\ndef low_ids(completions, **kw):\n"
        "    if os.environ.get('RANK') == '1':\n        raise ValueError('boom')\n"
        "    return [0.0] * len(completions)\n"
    )
    r = torchrun(2, cfgs["two"], timeout=180)
    assert r.returncode != 0
    err = r.stdout + r.stderr
    assert "error: rl.rewards[0]" in err and "raised ValueError: boom on completion" in err, err[-3000:]
    assert "failed, another rank stopped" not in err, err[-3000:]
    assert not list((tmp_path / "two").glob("checkpoints/step_*"))
