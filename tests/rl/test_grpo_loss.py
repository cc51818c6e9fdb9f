"""GRPO against TRL 1.16's own code, on fixed completions (rollouts given, not sampled).

The loss: TRL's `GRPOTrainer._compute_loss` and `_get_per_token_logps_and_entropies` called on a
stub trainer (the attributes they read, set as GRPOConfig would) over the model patched with
TRL's `add_fused_lm_head` (temperature-scaled log-probs, as GRPOTrainer patches it); horizon's
GRPOObjective (recipes.grpo.loss) through the streamed engine, the batch split over micro-batches.
For every loss_type, beta 0 and > 0 (k3 KL to a reference's log-probs), num_iterations 1 (old =
the policy, detached) and > 1 (old log-probs away from the policy: the clipped path, both sides),
truncated completions masked or not, temperature 1 and not: one step's loss and every gradient
(fp32, 1e-5) and the logged kl, entropy and clip ratios (the means, and the min / max over the
completions of two micro-batches).

Advantages: horizon's (rl.advantages) against TRL's formula in `_generate_and_score_completions`
(grpo_trainer.py, "sum_then_normalize": weighted nansum, unscorable rows NaN, group nanmean,
group or batch `nanstd` — TRL's own function — + 1e-4, nan_to_num), replicated below line by line
since it is inline in that method, for each scale_rewards, with None rewards and zero-std groups.
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, OptimConfig, RLConfig
from horizon_cli.data.batch import IGNORE, MicroBatch
from horizon_cli.engine import Engine
from horizon_cli.recipes.grpo.advantages import advantages
from horizon_cli.recipes.grpo.loss import GRPOObjective, GRPOPayload, ratio_metrics, token_means
from horizon_cli.recipes.grpo.policy import CLIPPED
from tests.support.oracle import check_grads, make_store, one_thread, rel_err  # noqa: F401

trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head, nanstd  # noqa: E402

B, P, C = 6, 5, 7  # completions, prompt length (equal: TRL left-pads prompts), most completion tokens
LENGTHS = [7, 3, 5, 7, 1, 6]
TRUNCATED = [True, False, False, True, False, False]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, store = make_store(tmp_path_factory.mktemp("grpo"), "llama", vocab_size=64)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, 64, (B, P), generator=g)
    comps = [torch.randint(3, 64, (n,), generator=g).tolist() for n in LENGTHS]
    adv = torch.randn(B, generator=g)
    adv = adv - adv.mean()  # both signs, as a group's advantages (the seed's draws are all > 0)
    noise_old = torch.randn(B, C, generator=g) * 0.25
    noise_ref = torch.randn(B, C, generator=g) * 0.5
    return types.SimpleNamespace(model=model, store=store, prompts=prompts, comps=comps, adv=adv,
                                 noise_old=noise_old, noise_ref=noise_ref)  # fmt: skip


def trl_stub(cfg: RLConfig, model) -> types.SimpleNamespace:
    """The attributes `_compute_loss` reads, as GRPOTrainer.__init__ sets them from a GRPOConfig
    (one process, one accumulated batch: steps_per_generation = gradient_accumulation_steps = 1)."""
    acc = types.SimpleNamespace(
        num_processes=1,
        is_main_process=True,
        autocast=contextlib.nullcontext,
        reduce=lambda x, reduction: x,
        gather=lambda x: x,
    )
    s = types.SimpleNamespace(
        beta=cfg.beta, loss_type=cfg.loss_type, epsilon_low=cfg.epsilon,
        epsilon_high=cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high,
        max_completion_length=cfg.max_completion_length, temperature=cfg.temperature,
        importance_sampling_level=cfg.importance_sampling_level, top_entropy_quantile=cfg.top_entropy_quantile,
        off_policy_mask_threshold=cfg.off_policy_mask_threshold,
        use_vllm=False, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1, accelerator=acc, model=model,
        args=types.SimpleNamespace(
            use_bias_correction_kl=cfg.use_bias_correction_kl, delta=cfg.delta, steps_per_generation=1,
            **{k: getattr(cfg, k) for k in TRL_ARGS},
        ),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask, get_gamma_weights=GRPOTrainer.get_gamma_weights,
    )  # fmt: skip
    acc.pad_across_processes = lambda x, dim, pad_index: x
    for name in ("_get_per_token_logps_and_entropies", "get_high_entropy_mask"):
        setattr(s, name, types.MethodType(getattr(GRPOTrainer, name), s))
    return s


TRL_ARGS = ("sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
            "vespo_lambda_neg")  # fmt: skip


def _trl_inputs(s, cfg: RLConfig, policy_logps: torch.Tensor) -> dict:
    cid = torch.zeros(B, C, dtype=torch.long)
    cmask = torch.zeros(B, C, dtype=torch.long)
    for r, c in enumerate(s.comps):
        cid[r, : len(c)] = torch.tensor(c)
        cmask[r, : len(c)] = 1
    if cfg.mask_truncated_completions:  # as _generate_and_score_completions masks them
        cmask = cmask * (~torch.tensor(TRUNCATED)).unsqueeze(1).long()
    out = {
        "prompt_ids": s.prompts, "prompt_mask": torch.ones(B, P, dtype=torch.long), "completion_ids": cid,
        "completion_mask": cmask, "advantages": s.adv.clone(), "num_items_in_batch": cmask.sum(),
    }  # fmt: skip
    if cfg.num_iterations > 1:
        out["old_per_token_logps"] = policy_logps + s.noise_old
    if cfg.beta > 0:
        out["ref_per_token_logps"] = policy_logps + s.noise_ref
    return out


def _ours(s, cfg: RLConfig, trl_in: dict, micro: int) -> list[MicroBatch]:
    """The same completions as horizon's rows (prompt + completion, labels on the completion),
    `micro` rows per micro-batch, the old and reference log-probs in label order."""
    mbs = []
    for a in range(0, B, micro):
        rows, olds, refs = [], [], []
        for r in range(a, min(B, a + micro)):
            c = s.comps[r]
            masked = cfg.mask_truncated_completions and TRUNCATED[r]
            rows.append((s.prompts[r].tolist() + c, [IGNORE] * P + ([IGNORE] * len(c) if masked else c)))
            if not masked:
                if "old_per_token_logps" in trl_in:
                    olds.append(trl_in["old_per_token_logps"][r, : len(c)])
                if "ref_per_token_logps" in trl_in:
                    refs.append(trl_in["ref_per_token_logps"][r, : len(c)])
        mb = MicroBatch.from_rows(rows, 0)
        mb.payload = GRPOPayload(
            s.adv[a : a + micro].clone(),
            len(rows),
            torch.cat(olds) if olds else None,
            torch.cat(refs) if refs else None,
        )
        mbs.append(mb)
    return mbs


CASES = [
    dict(loss_type=lt, beta=beta, num_iterations=mu)
    for lt in ("grpo", "dr_grpo", "dapo", "bnpo")
    for beta in (0.0, 0.04)
    for mu in (1, 2)
] + [
    dict(loss_type="dapo", beta=0.04, num_iterations=2, mask_truncated_completions=True, temperature=0.7),
    dict(
        loss_type="grpo",
        beta=0.0,
        num_iterations=2,
        mask_truncated_completions=True,
        epsilon_high=0.28,
        epsilon=0.1,
    ),
    dict(loss_type="dr_grpo", beta=0.1, num_iterations=1, temperature=1.3),
    dict(loss_type="bnpo", beta=0.04, num_iterations=2, use_bias_correction_kl=False),
]
# TRL 1.16's further losses and options (recipes.grpo.policy); the sequence-level cases with a
# narrower epsilon, so that a completion's mean ratio leaves the band
MORE = [
    dict(loss_type="cispo", beta=0.04, num_iterations=2, epsilon_high=1.1),
    dict(loss_type="cispo", beta=0.0, num_iterations=1, mask_truncated_completions=True),
    dict(loss_type="luspo", beta=0.0, num_iterations=2, importance_sampling_level="sequence", epsilon=0.05),
    dict(loss_type="luspo", beta=0.04, num_iterations=1, mask_truncated_completions=True),
    dict(loss_type="sapo", beta=0.0, num_iterations=2),
    dict(loss_type="sapo", beta=0.04, num_iterations=2, sapo_temperature_pos=0.5, sapo_temperature_neg=2.0),
    dict(loss_type="vespo", beta=0.0, num_iterations=2),
    dict(loss_type="vespo", beta=0.04, num_iterations=2, mask_truncated_completions=True, vespo_k_pos=1.5,
         vespo_lambda_neg=1.0, temperature=0.7),
    dict(loss_type="vespo", beta=0.0, num_iterations=1),
    dict(loss_type="grpo", beta=0.0, num_iterations=2, importance_sampling_level="sequence", epsilon=0.05),
    dict(loss_type="grpo", beta=0.04, num_iterations=2, importance_sampling_level="sequence", epsilon=0.05),
    dict(loss_type="sapo", beta=0.04, num_iterations=2, importance_sampling_level="sequence",
         mask_truncated_completions=True),
    dict(loss_type="dapo", beta=0.04, num_iterations=2, importance_sampling_level="sequence", delta=1.1,
         epsilon=0.05),
    dict(loss_type="grpo", beta=0.0, num_iterations=2, delta=1.15, epsilon=0.1),
    dict(loss_type="dapo", beta=0.04, num_iterations=2, off_policy_mask_threshold=0.02),
    dict(loss_type="grpo", beta=0.0, num_iterations=2, top_entropy_quantile=0.3),
    dict(loss_type="dr_grpo", beta=0.04, num_iterations=1, top_entropy_quantile=0.0, temperature=0.7),
    dict(loss_type="cispo", beta=0.04, num_iterations=2, top_entropy_quantile=0.5, off_policy_mask_threshold=0.0,
         mask_truncated_completions=True),
]  # fmt: skip
CASES += MORE


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_loss_gradients_and_metrics_equal_trls_compute_loss(setup, case):
    s = setup
    cfg = RLConfig(max_completion_length=C, rewards=[], **case)
    model = copy.deepcopy(s.model).train()
    add_fused_lm_head(model, temperature=cfg.temperature, outputs=("log_probs", "entropy"))
    stub = trl_stub(cfg, model)
    with torch.no_grad():  # the policy's own log-probs, where the old and reference ones are set from
        ids = torch.cat([s.prompts, _trl_inputs(s, cfg, torch.zeros(B, C))["completion_ids"]], 1)
        lp, _, _ = stub._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), C)
    trl_in = _trl_inputs(s, cfg, lp)
    loss = GRPOTrainer._compute_loss(stub, model, trl_in)
    loss.backward()
    metrics = {k: v[-1] for k, v in stub._metrics["train"].items()}

    eng = Engine(s.store, EngineConfig(device="cpu", dtype="float32", loss_chunk=5), OptimConfig(kernel="torch"),
                 objective=GRPOObjective(cfg))  # fmt: skip
    try:
        mbs = _ours(s, cfg, trl_in, micro=4)  # two micro-batches of 4 and 2 completions
        div = eng.objective.divisor(mbs)
        loss_sum, n, _ = eng.forward_backward(mbs, div)
        _, _, stats = eng.evaluate(mbs)
        assert abs(loss_sum / n - loss.item()) <= 1e-5 * max(abs(loss.item()), 1e-2)
        check_grads(eng, model, 1e-5)
        if cfg.beta > 0:
            assert stats["kl"] / stats["tokens"] == pytest.approx(metrics["kl"], rel=1e-5)
        assert token_means(cfg, stats)["entropy"] == pytest.approx(metrics["entropy"], rel=1e-5)
        ours = ratio_metrics(replace(cfg, num_iterations=2), stats)  # every ratio metric TRL logs
        assert (bool(ours) or cfg.loss_type == "sapo") and set(ours) <= set(metrics)
        if cfg.loss_type in CLIPPED:  # TRL's min / max over completions, across the micro-batches
            assert {"clip_ratio/low_min", "clip_ratio/high_max"} <= set(ours)
        for k, v in ours.items():
            assert v == pytest.approx(metrics[k], rel=1e-5, abs=1e-7), k
        if cfg.num_iterations > 1 and "clip_region" in stats:
            assert stats["clip_region"] > 0  # the clipped path is taken
    finally:
        eng.close()


def trl_advantages(per_func, weights, G, scale):
    """TRL 1.16 `_generate_and_score_completions`, sum_then_normalize, as written there."""
    unscorable_mask = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    if scale in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards)
    adv = rewards - mean_grouped_rewards
    if scale != "none":
        adv = adv / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    return torch.nan_to_num(adv, nan=0.0), rewards, is_std_zero


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls(scale):
    g = torch.Generator().manual_seed(7)
    G = 4
    per = torch.randn(16, 2, generator=g)
    per[1, 0] = torch.nan  # one function returned None
    per[5] = torch.nan  # every function: unscorable
    per[8:12] = torch.tensor([1.0, 0.5])  # a group whose rewards are all alike: std 0
    w = torch.tensor([1.0, 0.3])
    ours, r, zero = advantages(per, w, G, scale)
    theirs, tr, tz = trl_advantages(per, w, G, scale)
    assert rel_err(ours, theirs) < 1e-6 and torch.equal(zero, tz)
    assert torch.equal(torch.isnan(r), torch.isnan(tr)) and rel_err(r.nan_to_num(), tr.nan_to_num()) < 1e-6
    assert ours[5] == 0 and (ours[8:12] == 0).all()
