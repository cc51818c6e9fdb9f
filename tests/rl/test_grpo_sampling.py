"""The importance-sampling correction between a sampler and the policy (recipes.grpo.sampling)
against TRL 1.16, given the same sampling log-probs.

The ratio and its metrics: TRL's formula in `_generate_and_score_completions` (the
`use_vllm and vllm_importance_sampling_correction` block), replicated below line by line since it is
inline in that method, for every mode and clip bounds. The corrected loss: TRL's own
`GRPOTrainer._compute_loss` on a stub as in test_grpo_loss.py, with use_vllm on and the inputs it is
given under vLLM (old log-probs always, the sampler's, the ratio), against horizon's GRPOObjective
through the streamed engine with the sampler's log-probs in the payload and the ratio from
`sampling.correct` over the batch: loss, every gradient, the ratio metrics; every mode, vespo (the
ratio folded into its weight) and the off-policy mask (which reads the sampler's log-probs).
The config refusals TRL makes: one line, exit 2.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, OptimConfig, RLConfig
from horizon_cli.engine import Engine
from horizon_cli.recipes.grpo.loss import GRPOObjective, payload_of
from horizon_cli.recipes.grpo.sampling import correct
from tests.rl.test_grpo_loss import B, C, _ours, _trl_inputs, setup, trl_stub  # noqa: F401
from tests.support.oracle import check_grads

trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

MODES = ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"]


def trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16 `_generate_and_score_completions`, the vLLM importance-sampling block, as written
    there; -> (the ratio, TRL's five sampling/ metrics)."""
    per_token_logps_diff = (old - sampling) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True) if sequence_level_is else per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    delta = torch.abs(old - sampling)
    delta = delta[mask.bool() & ~torch.isnan(delta)]
    flat = ratio.flatten() if sequence_level_is else ratio[mask.bool()]
    metrics = {
        "sampling/sampling_logp_difference/mean": delta.mean().item(),
        "sampling/sampling_logp_difference/max": delta.max().item(),
        "sampling/importance_sampling_ratio/min": flat.min().item(),
        "sampling/importance_sampling_ratio/mean": flat.mean().item(),
        "sampling/importance_sampling_ratio/max": flat.max().item(),
    }
    return ratio, metrics


CASES = [dict(importance_sampling_mode=m) for m in MODES] + [
    dict(importance_sampling_mode="token_truncate", importance_sampling_clip_min=0.9, importance_sampling_clip_max=1.1),
    dict(importance_sampling_mode="token_mask", importance_sampling_clip_min=0.8, importance_sampling_clip_max=None),
    dict(importance_sampling_mode="sequence_mask", importance_sampling_clip_max=1.2, loss_type="grpo", beta=0.04),
    dict(importance_sampling_mode="sequence_truncate", importance_sampling_clip_max=1.1, loss_type="sapo"),
    dict(importance_sampling_mode="token_mask", importance_sampling_clip_max=1.2, loss_type="vespo",
         mask_truncated_completions=True),
    dict(importance_sampling_mode="token_truncate", importance_sampling_clip_max=1.2, loss_type="vespo", beta=0.04),
    dict(importance_sampling_mode="token_truncate", importance_sampling_clip_max=1.2, loss_type="cispo",
         off_policy_mask_threshold=0.2, num_iterations=2),
    dict(importance_sampling_mode="sequence_mask", importance_sampling_clip_max=1.3, loss_type="dr_grpo",
         mask_truncated_completions=True, importance_sampling_level="sequence", num_iterations=2),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_corrected_loss_gradients_and_metrics_equal_trls(setup, case):  # noqa: F811
    s = setup
    cfg = RLConfig(max_completion_length=C, rewards=[], **({"num_iterations": 1} | case))
    model = copy.deepcopy(s.model).train()
    add_fused_lm_head(model, temperature=cfg.temperature, outputs=("log_probs", "entropy"))
    stub = trl_stub(cfg, model)
    stub.use_vllm, stub.vllm_importance_sampling_correction = True, True
    with torch.no_grad():
        ids = torch.cat([s.prompts, _trl_inputs(s, cfg, torch.zeros(B, C))["completion_ids"]], 1)
        lp, _, _ = stub._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), C)
    trl_in = _trl_inputs(s, cfg, lp)
    old = trl_in.get("old_per_token_logps", lp)  # under vLLM TRL always has the old log-probs
    g = torch.Generator().manual_seed(11)
    sampling = old + torch.randn(B, C, generator=g) * 0.3  # a sampler near, not equal to, the weights
    sampling[1, 0] = torch.nan  # a token the sampler could not score: ratio 1, no gap
    ratio, metrics_is = trl_is_ratio(old, sampling, trl_in["completion_mask"], cfg.importance_sampling_mode,
                                     cfg.importance_sampling_clip_min, cfg.importance_sampling_clip_max)  # fmt: skip
    real = ratio[trl_in["completion_mask"].bool()] if ratio.shape[1] > 1 else ratio
    assert (real != 1).any() and (real != real.flatten()[0]).any()  # the correction does something
    lo, hi = cfg.importance_sampling_clip_min, cfg.importance_sampling_clip_max
    if {"importance_sampling_clip_min", "importance_sampling_clip_max"} & set(case):  # bounds that bind
        if cfg.importance_sampling_mode.endswith("mask"):
            assert (real == 0).any()  # a ratio out of the bounds is masked
        else:
            assert ((real == lo) | (real == hi)).any()  # ... or truncated to them
    if cfg.off_policy_mask_threshold is not None:  # the sampler's log-probs, not the old ones, decide
        opm = [GRPOTrainer.get_off_policy_mask(s.adv.unsqueeze(1), lp, x, trl_in["completion_mask"],
                                               cfg.off_policy_mask_threshold) for x in (sampling, old)]  # fmt: skip
        assert not torch.equal(*opm)
    trl_in |= {
        "old_per_token_logps": old,
        "sampling_per_token_logps": sampling,
        "importance_sampling_ratio": ratio,
    }
    loss = GRPOTrainer._compute_loss(stub, model, trl_in)
    loss.backward()

    eng = Engine(s.store, EngineConfig(device="cpu", dtype="float32", loss_chunk=5), OptimConfig(kernel="torch"),
                 objective=GRPOObjective(cfg))  # fmt: skip
    try:
        mbs = _ours(s, cfg, trl_in, micro=4)
        for mb, (a, b) in zip(mbs, [(0, 4), (4, B)], strict=True):
            keep = [r for r in range(a, b) if trl_in["completion_mask"][r].any()]
            payload_of(mb).sampling = torch.cat([sampling[r, : len(s.comps[r])] for r in keep])
        ours_m = correct(cfg, mbs)
        for k, v in metrics_is.items():
            assert ours_m[k] == pytest.approx(v, rel=1e-6), k
        loss_sum, n, _ = eng.forward_backward(mbs, eng.objective.divisor(mbs))
        assert abs(loss_sum / n - loss.item()) <= 1e-5 * max(abs(loss.item()), 1e-2)
        check_grads(eng, model, 1e-5)
    finally:
        eng.close()


REFUSED = [
    ({"importance_sampling_clip_min": 3.0}, "rl.importance_sampling_clip_min: 3.0 must be less than"),
    ({"importance_sampling_mode": "token_truncate", "importance_sampling_clip_max": None},
     "rl.importance_sampling_mode: token_truncate needs importance_sampling_clip_min or _clip_max set"),
    ({"loss_type": "vespo"}, "rl.importance_sampling_mode: vespo needs token_truncate or token_mask"),
    ({"importance_sampling_mode": "token"}, "rl.importance_sampling_mode: 'token' is not allowed"),
]  # fmt: skip


@pytest.mark.parametrize("keys,line", REFUSED, ids=[r[1][:40] for r in REFUSED])
def test_combinations_trl_refuses_are_refused_in_one_line(tmp_path, tiny_store, keys, line):
    from tests.rl.test_grpo_train import _cfg, horizon, one_error_line

    cfg = _cfg(tmp_path, tiny_store, {"rewards": [{"function": "length", "target": 4}], **keys})
    assert line in one_error_line(horizon("train", cfg))
    assert not (tmp_path / "run").exists()


def test_a_sampler_apart_is_corrected_and_the_streamed_one_is_not(tmp_path, tiny_store, monkeypatch):
    """`horizon train` end to end: the streamed sampler's rollouts carry no sampling log-probs, so
    no correction runs (no sampling/ metric); a sampler whose rollouts carry them (a stand-in that
    says the sampled tokens had log-probs -1 and -12 in turn) gets the old log-probs swept, the ratio over the batch,
    TRL's metrics (the ratio truncated at clip_max) and a loss that differs from the uncorrected one."""
    from horizon_cli.recipes.grpo import rollouts as ro
    from horizon_cli.train.metrics import read_metrics
    from tests.rl.test_grpo_train import _run

    rl = {"importance_sampling_mode": "token_truncate", "importance_sampling_clip_max": 2.0}
    plain = read_metrics(_run(tmp_path, tiny_store, "plain", rl, ["train.steps=2"]) / "metrics.jsonl")
    assert plain and not any(k.startswith("sampling/") for r in plain for k in r)
    real = ro.sample

    def apart(*a, **kw):
        return [
            replace(o, sampling=[-1.0 - 11.0 * (k % 2) for k in range(len(o.ids))]) for o in real(*a, **kw)
        ]

    monkeypatch.setattr(ro, "sample", apart)
    rows = read_metrics(_run(tmp_path, tiny_store, "apart", rl, ["train.steps=2"]) / "metrics.jsonl")
    for r, p in zip(rows, plain, strict=True):
        assert r["reward"] == p["reward"]  # the same rollouts
        assert 0 < r["sampling/importance_sampling_ratio/min"] <= r["sampling/importance_sampling_ratio/mean"]
        assert r["sampling/importance_sampling_ratio/max"] == pytest.approx(2.0)  # old - (-12) > log 2
        assert r["sampling/sampling_logp_difference/max"] >= r["sampling/sampling_logp_difference/mean"] > 0
        assert r["loss"] != p["loss"]
