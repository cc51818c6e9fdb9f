"""`horizon train` with an `rl:` section: the rollouts it writes, TRL's metric names, five
optimizer steps against TRL 1.16's GRPO loss (its own `_compute_loss` on a stub trainer, as in
test_grpo_loss) + torch.optim.AdamW on a resident transformers model over the same completions
(read back from rollouts/step-N.jsonl: the rollouts are what horizon sampled; the loss, the
gradient norm, kl and the final weights are compared), a resumed run equal to an uninterrupted
one (inside a num_iterations group too), and the one-line refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from horizon_cli.config.schema import RLConfig
from horizon_cli.recipes.grpo.advantages import advantages
from tests.conftest import horizon, write_config, write_jsonl
from tests.support.oracle import one_thread, rel_err  # noqa: F401
from tests.train.test_train_cli import one_error_line

trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from tests.rl.test_grpo_loss import trl_stub  # noqa: E402

P = 6  # every prompt this many tokens: TRL left-pads prompts and does not shift positions
REWARD = '''
def low_ids(completion_ids, bias, **kw):
    """The share of a completion's tokens below 200, plus the record's bias column."""
    return [sum(t < 200 for t in c) / len(c) + b for c, b in zip(completion_ids, bias)]
'''


def _prompts(n: int = 12) -> list[dict]:
    g = torch.Generator().manual_seed(11)
    return [{"prompt_input_ids": torch.randint(3, 400, (P,), generator=g).tolist(), "bias": 0.1 * (i % 3)}
            for i in range(n)]  # fmt: skip


def _run(tmp_path, tiny_store, name: str, rl: dict, overrides=(), **sections):
    from rich.console import Console

    from horizon_cli.train import run_training

    data = write_jsonl(tmp_path / "p.jsonl", _prompts())
    (tmp_path / "rw.py").write_text(REWARD)
    rl = {"num_generations": 4, "max_completion_length": 8,
          "rewards": [{"function": f"{tmp_path / 'rw.py'}:low_ids"}, {"function": "length", "target": 5, "weight": 0.5}],
          **rl}  # fmt: skip
    cfg = write_config(tmp_path / f"{name}.yaml", tiny_store, data, tmp_path / name, rl=rl,
                       train={"steps": 5, "batch_size": 2, "micro_batch_size": 3, "seed": 2},
                       schedule={"kind": "constant", "warmup_steps": 0}, **sections)  # fmt: skip
    threads = torch.get_num_threads()
    try:
        run_training(cfg, list(overrides), console=Console(quiet=True))
    finally:
        torch.set_num_threads(threads)
    return tmp_path / name


def _rollouts(run, n: int) -> list[dict]:
    return [json.loads(x) for x in (run / "rollouts" / f"step-{n}.jsonl").read_text().splitlines()]


CASES = {
    "dapo-beta-mu1": dict(beta=0.04),
    "grpo-mu2-clipped": dict(loss_type="grpo", num_iterations=2, temperature=0.8, epsilon=0.05),
}


@pytest.mark.parametrize("case", list(CASES))
def test_five_steps_equal_trl_loss_with_adamw(tmp_path, tiny_store, case):
    import transformers

    from horizon_cli.train.metrics import read_metrics

    rlkw = CASES[case]
    run = _run(tmp_path, tiny_store, "run", rlkw, output={"save_every": 0, "export": True})
    rows = read_metrics(run / "metrics.jsonl")
    assert len(rows) == 5
    cfg = RLConfig(max_completion_length=8, num_generations=4, **rlkw)
    hf = tiny_store.parent / "hf"
    policy = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).train()
    ref = copy.deepcopy(policy).eval()
    add_fused_lm_head(policy, temperature=cfg.temperature, outputs=("log_probs", "entropy"))
    add_fused_lm_head(ref, temperature=cfg.temperature)
    stub = trl_stub(cfg, policy)
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    old = None
    for k, row in enumerate(rows):
        g = k - k % cfg.num_iterations
        rs = _rollouts(run, g + 1)
        assert len(rs) == 8 and all(
            r["prompt_ids"] == rs[4 * (i // 4)]["prompt_ids"] for i, r in enumerate(rs)
        )
        C = max(len(r["completion_ids"]) for r in rs)
        cid = torch.zeros(8, C, dtype=torch.long)
        cmask = torch.zeros(8, C, dtype=torch.long)
        for i, r in enumerate(rs):
            cid[i, : len(r["completion_ids"])] = torch.tensor(r["completion_ids"])
            cmask[i, : len(r["completion_ids"])] = 1
        pid = torch.tensor([r["prompt_ids"] for r in rs])
        ids = torch.cat([pid, cid], 1)
        am = torch.cat([torch.ones_like(pid), cmask], 1)
        # the advantages written are TRL's of the rewards written
        per = torch.tensor([[r["rewards"]["low_ids"], r["rewards"]["length"]] for r in rs])
        adv, _, _ = advantages(per, torch.tensor([1.0, 0.5]), 4, cfg.scale_rewards)
        assert rel_err(adv, torch.tensor([r["advantage"] for r in rs])) < 1e-6
        inputs = {"prompt_ids": pid, "prompt_mask": torch.ones_like(pid), "completion_ids": cid,
                  "completion_mask": cmask, "advantages": adv, "num_items_in_batch": cmask.sum()}  # fmt: skip
        with torch.no_grad():
            if cfg.num_iterations > 1 and k == g:  # the rollout policy: the weights that sampled them
                old, _, _ = stub._get_per_token_logps_and_entropies(policy, ids, am, C)
            if cfg.num_iterations > 1:
                inputs["old_per_token_logps"] = old
            if cfg.beta > 0:
                inputs["ref_per_token_logps"], _, _ = stub._get_per_token_logps_and_entropies(ref, ids, am, C)
        opt.zero_grad()
        stub._metrics["train"].clear()
        loss = GRPOTrainer._compute_loss(stub, policy, inputs)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        metrics = {m: v[-1] for m, v in stub._metrics["train"].items()}
        assert row["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7), k
        assert row["grad_norm"] == pytest.approx(norm.item(), rel=1e-5), k
        if cfg.beta > 0:
            assert row["kl"] == pytest.approx(metrics["kl"], rel=1e-3, abs=1e-7), k
        if cfg.num_iterations > 1:
            assert row["clip_ratio/region_mean"] == pytest.approx(
                metrics["clip_ratio/region_mean"], abs=1e-6
            ), k
    if cfg.num_iterations > 1:
        assert any(r["clip_ratio/region_mean"] for r in rows)  # the clipped path was taken
    out = transformers.AutoModelForCausalLM.from_pretrained(run / "export", dtype=torch.float32).state_dict()
    # the gradients agree to ~1e-6 each step (grad_norm above); AdamW turns the fp32 rounding of a
    # gradient element near zero into an lr-sized update of either sign (m / sqrt(v)), so a few
    # elements of the weights drift further apart than the gradients do
    for name, w in policy.state_dict().items():
        assert rel_err(out[name], w) < 1e-3, name


def test_rollouts_file_and_trls_metric_names(tmp_path, tiny_store):
    run = _run(tmp_path, tiny_store, "run", {"beta": 0.04}, ["train.steps=2"])
    rs = _rollouts(run, 1)
    assert {*rs[0]} == {
        "prompt",
        "prompt_ids",
        "completion_ids",
        "completion",
        "rewards",
        "reward",
        "advantage",
        "truncated",
    }
    for r in rs:
        assert 1 <= len(r["completion_ids"]) <= 8 and r["prompt_ids"] in [
            p["prompt_input_ids"] for p in _prompts()
        ]
        assert r["reward"] == pytest.approx(r["rewards"]["low_ids"] + 0.5 * r["rewards"]["length"], rel=1e-6)
        assert r["truncated"] == (len(r["completion_ids"]) == 8 and r["completion_ids"][-1] != 2)
    from horizon_cli.train.metrics import read_metrics

    row = read_metrics(run / "metrics.jsonl")[0]
    for k in ("reward", "reward_std", "rewards/low_ids/mean", "rewards/length/mean", "frac_reward_zero_std",
              "completions/mean_length", "completions/clipped_ratio", "kl", "rollout_s", "rollout_tokens_per_s"):  # fmt: skip
        assert row[k] is not None, k
    assert row["clip_ratio/region_mean"] == 0.0  # logged at num_iterations 1 too (ratio 1), as TRL
    assert row["reward"] == pytest.approx(sum(r["reward"] for r in rs) / 8, rel=1e-5)


@pytest.mark.parametrize("mu", [1, 2])
def test_a_resumed_run_samples_and_trains_as_an_uninterrupted_one(tmp_path, tiny_store, mu):
    """Cut after step 3 and resumed: the same rollouts (files equal byte for byte), losses and
    weights; with num_iterations 2 the resumed step 4 reuses step 3's rollouts from the run dir."""
    rl = {"num_iterations": mu, "beta": 0.04 if mu == 1 else 0.0}
    out = {"save_every": 1, "keep_last": 5}
    whole = _run(tmp_path, tiny_store, "whole", rl, ["train.steps=4"], output=out)
    _run(tmp_path, tiny_store, "cut", rl, ["train.steps=3"], output=out)
    cut = _run(tmp_path, tiny_store, "cut", rl, ["train.steps=4"], output=out)
    from horizon_cli.train.metrics import read_metrics

    a, b = (read_metrics(r / "metrics.jsonl") for r in (whole, cut))
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and [r["reward"] for r in a] == [
        r["reward"] for r in b
    ]
    assert [r["num_tokens"] for r in a] == [r["num_tokens"] for r in b]  # counted on across the resume
    for f in sorted((whole / "rollouts").glob("*.jsonl")):
        assert f.read_bytes() == (cut / "rollouts" / f.name).read_bytes(), f.name
    ca, cb = (r / "checkpoints" / "step_4" for r in (whole, cut))
    files = [f.relative_to(ca) for f in ca.rglob("*.bin")]
    assert files and all((ca / f).read_bytes() == (cb / f).read_bytes() for f in files)


def _cfg(tmp_path, tiny_store, rl: dict) -> object:
    data = write_jsonl(tmp_path / "p.jsonl", _prompts())
    return write_config(
        tmp_path / "c.yaml", tiny_store, data, tmp_path / "run", rl={"max_completion_length": 8, **rl}
    )


@pytest.mark.parametrize(
    "rl, msg",
    [
        ({"num_generations": 1, "rewards": [{"function": "length", "target": 4}]}, "rl.num_generations: 1 is below the minimum 2"),
        ({"beta": -0.1, "rewards": [{"function": "length", "target": 4}]}, "rl.beta: -0.1 is below the minimum 0.0"),
        ({"loss_type": "ppo", "rewards": [{"function": "length", "target": 4}]}, "rl.loss_type: 'ppo' is not allowed"),
        ({"rewards": [{"function": "nowhere.py:f"}]}, "rl.rewards[0].function: nowhere.py does not exist"),
        ({"rewards": []}, "rl.rewards: give at least one reward function"),
        ({"rewards": [{"function": "format"}]}, "rl.rewards[0].pattern: the built-in format reward needs it"),
    ],
)  # fmt: skip
def test_bad_rl_values_are_one_line_exit_2(tmp_path, tiny_store, rl, msg):
    assert msg in one_error_line(horizon("train", _cfg(tmp_path, tiny_store, rl)))
    assert not (tmp_path / "run").exists()


BAD = {
    "raises": ("    raise ValueError('boom')\n", "raised ValueError: boom on completion"),
    "count": ("    return [1.0]\n", "returned 1 values for 8 completions (step 3)"),
    "nan": ("    return [float('nan')] * len(completions)\n", "returned NaN for completion 1 of"),
    "text": ("    return ['good'] * len(completions)\n", "returned 'good' (not a number) for completion 1"),
}  # fmt: skip


@pytest.mark.parametrize("bad", list(BAD))
def test_a_failing_reward_function_stops_with_one_line_and_keeps_the_checkpoint(tmp_path, tiny_store, bad):
    """The function scores steps 1 and 2 (step_2 checkpointed), then fails at step 3: one line
    naming it and the sample, exit 2, step_2 still the newest checkpoint, whole (deep checksums),
    its files as they were, and nothing of step 3 written (no rollouts, no metrics line)."""
    from horizon_cli.store import ckpt

    body, msg = BAD[bad]
    if bad == "raises":  # fails on one sample only: that one is named
        body = "    if len(prompts) > 1 or prompts[0][0] % 2:\n        raise ValueError('boom')\n    return [0.0]\n"
    (tmp_path / "bad.py").write_text(
        "def f(completions, prompts, trainer_state, **kw):\n    if trainer_state.global_step < 2:\n"
        "        return [0.5 * (len(c) % 3) for c in completions]\n" + body
    )
    rl = {
        "num_generations": 4,
        "max_completion_length": 4,
        "rewards": [{"function": f"{tmp_path / 'bad.py'}:f"}],
    }
    cfg = _cfg(tmp_path, tiny_store, rl)
    run = tmp_path / "run"

    def snapshot(ck):  # every file of step_2 as the step-2 save wrote it
        return {p.relative_to(ck): p.read_bytes() for p in sorted(ck.rglob("*")) if p.is_file()}

    over = ("train.batch_size=2", "schedule.kind=constant")  # constant: train.steps may grow
    assert horizon("train", cfg, *over, "train.steps=2").exit_code == 0
    before = snapshot(run / "checkpoints" / "step_2")
    r = horizon("train", cfg, *over, "train.steps=6")
    line = one_error_line(r)
    assert r.exit_code == 2 and "rl.rewards[0] (f): " in line and msg in line, line
    good, bad_ones = ckpt.intact(run)
    assert [p.name for p in good] == ["step_2"] and not bad_ones
    assert ckpt.check(good[0], deep=True) is None and snapshot(good[0]) == before
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["step-1.jsonl", "step-2.jsonl"]
    from horizon_cli.train.metrics import read_metrics

    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_reference_is_the_initial_model(tmp_path, tiny_store, lora):
    """beta > 0: at step 1 the policy is the reference (a forward-only engine on the store; fresh
    LoRA adapters: the base, adapters off), so kl is 0 exactly; after an update it is not."""
    from horizon_cli.train.metrics import read_metrics

    extra = {"lora": {"r": 4, "alpha": 8}} if lora else {}
    run = _run(tmp_path, tiny_store, "run", {"beta": 0.04}, ["train.steps=2", "optim.lr=0.02"], **extra)
    rows = read_metrics(run / "metrics.jsonl")
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0


def test_the_rl_section_is_part_of_the_trajectory(tmp_path, tiny_store):
    """Resuming with another rl value (or without rl:) is refused unless train.accept_changes names it."""
    rl = {"num_generations": 2, "max_completion_length": 4, "rewards": [{"function": "length", "target": 2}]}
    cfg = _cfg(tmp_path, tiny_store, rl)
    assert horizon("train", cfg, "train.steps=2").exit_code == 0
    line = one_error_line(horizon("train", cfg, "train.steps=3", "rl.beta=0.1"))
    assert "rl.beta 0.0 -> 0.1" in line and "train.accept_changes=[rl.beta]" in line


def test_builtin_rewards_and_the_accuracy_extra():
    from horizon_cli.config.schema import RewardConfig
    from horizon_cli.errors import InputError
    from horizon_cli.recipes.grpo.rewards import load_rewards

    fmt, length = load_rewards(
        [
            RewardConfig(function="format", pattern=r"\s*\d+"),
            RewardConfig(function="length", target=4, tolerance=1),
        ]
    )
    assert fmt.fn(completions=[" 42", "42 is it", [{"role": "assistant", "content": "7"}]]) == [1.0, 0.0, 1.0]
    assert length.fn(completion_ids=[[1] * 4, [1] * 5, [1] * 7, [1] * 12]) == [1.0, 1.0, 0.5, 0.0]
    try:
        import math_verify  # noqa: F401
    except ImportError:
        with pytest.raises(
            InputError, match=r"rl.rewards\[0\].function: the accuracy reward needs math-verify"
        ):
            load_rewards([RewardConfig(function="accuracy")])
    else:
        (acc,) = load_rewards([RewardConfig(function="accuracy")])
        assert acc.fn(completions=[r"so \boxed{3}", r"\boxed{4}"], solution=["$3$", "$3$"]) == [1.0, 0.0]


def test_conversational_prompts_give_message_completions(tmp_path, tiny_store):
    """`prompt` as messages: rendered with the chat template's generation prompt; the reward
    functions get message-list completions and the records' other columns, one per completion."""
    from horizon_cli.train.metrics import read_metrics

    recs = [{"prompt": [{"role": "user", "content": f"say {w}"}], "word": w} for w in ("a", "b", "c", "d")]
    data = write_jsonl(tmp_path / "chat.jsonl", recs)
    (tmp_path / "rw.py").write_text(
        "def f(prompts, completions, word, **kw):\n"
        "    assert all(isinstance(c, list) and c[0]['role'] == 'assistant' for c in completions)\n"
        "    assert all(p[0]['content'] == 'say ' + w for p, w in zip(prompts, word))\n"
        "    return [float(len(c[0]['content']) % 3) for c in completions]\n"
    )
    rl = {
        "num_generations": 2,
        "max_completion_length": 4,
        "rewards": [{"function": f"{tmp_path / 'rw.py'}:f"}],
    }
    cfg = write_config(
        tmp_path / "c.yaml", tiny_store, data, tmp_path / "run", rl=rl, train={"steps": 1, "batch_size": 2}
    )
    r = horizon("train", cfg)
    assert r.exit_code == 0, r.output
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[0]["rewards/f/mean"] is not None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_store.parent / "hf")
    want = tok(tok.apply_chat_template(recs[0]["prompt"], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]  # fmt: skip
    got = [x["prompt_ids"] for x in _rollouts(tmp_path / "run", 1)]
    assert want in got


def test_eval_samples_the_held_out_prompts_and_reports_trls_metrics(tmp_path, tiny_store):
    from horizon_cli.train.metrics import read_metrics

    run = _run(
        tmp_path, tiny_store, "run", {}, ["train.steps=2", "train.eval_every=2", "data.eval_fraction=0.25"]
    )
    row = read_metrics(run / "metrics.jsonl")[-1]
    assert row["eval_loss"] is not None and row["eval_reward"] is not None
    assert (
        row["eval_completions/min_length"]
        <= row["eval_completions/mean_length"]
        <= row["eval_completions/max_length"]
    )
    assert not any(f.name.startswith("step-0") for f in (run / "rollouts").iterdir())
    # the evaluation's rollouts, written like a step's: one file, the prompt as the record holds it
    held = [json.loads(ln) for ln in (run / "rollouts" / "eval-step-2.jsonl").read_text().splitlines()]
    assert len(held) == 3 * 4 and all(x["prompt"] == x["prompt_ids"] and "advantage" in x for x in held)
    means = [sum(x["reward"] for x in b) / len(b) for b in (held[:8], held[8:])]  # batches of 2 and 1 prompts
    assert row["eval_reward"] == pytest.approx(sum(means) / 2, rel=1e-5)  # TRL's mean of the batches'
    assert row["eval_num_tokens"] == row["num_tokens"] and row["eval_entropy"] > 0
    # TRL's eval clip ratios: the policy that sampled is the one scored (ratio 1): none clipped
    assert row["eval_clip_ratio/region_mean"] == 0 and row["eval_clip_ratio/high_max"] == 0


def test_a_slice_of_the_prompts_sampled_alone_gets_the_whole_batchs_completions(tiny_store):
    """rl.rollouts.sample seeds each row by its place in the step's whole batch (`first`): the
    second half of the prompts sampled alone (as a rank of two would) gets exactly the completions
    the whole batch gives it, and without the offset it does not."""
    from types import SimpleNamespace

    from horizon_cli.config.schema import EngineConfig, OptimConfig
    from horizon_cli.engine import Engine
    from horizon_cli.recipes.grpo.rollouts import sample
    from horizon_cli.store import Store

    prompts = [p["prompt_input_ids"] for p in _prompts(4)]
    rl = SimpleNamespace(
        temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_completion_length=8
    )
    eng = Engine(Store.open(tiny_store), EngineConfig(device="cpu", dtype="float32"), OptimConfig(),
                 forward_only=True)  # fmt: skip
    try:
        whole = sample(eng, prompts, 3, rl, 5, [], None, "device")
        half = sample(eng, prompts[2:], 3, rl, 5, [], None, "device", first=2)
        plain = sample(eng, prompts[2:], 3, rl, 5, [], None, "device")
    finally:
        eng.close()
    assert [(r.prompt, r.ids) for r in whole[6:]] == [(r.prompt + 2, r.ids) for r in half]
    assert [r.ids for r in plain] != [r.ids for r in whole[6:]]
