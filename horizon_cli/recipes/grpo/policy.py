"""The per-token GRPO policy loss of TRL 1.16's `GRPOTrainer._compute_loss`, on a step's labelled
tokens laid flat (recipes.grpo.loss gathers them): every loss_type, importance_sampling_level, delta,
off_policy_mask_threshold, top_entropy_quantile, use_bias_correction_kl, as TRL computes them.

With lp the policy's log-prob of a token, old the rollout policy's, A its completion's advantage:

    log_ratio = lp - old;  log w = log_ratio (level token) or its mean over the completion (sequence)
    cispo     -min(w, epsilon_high).detach() A lp
    grpo, dr_grpo, dapo, bnpo, luspo
              -min(min(w, delta) A, clamp(w, 1 - epsilon, 1 + epsilon_high) A)   (delta None: w)
    sapo      -sigmoid(tau (w - 1)) 4 / tau A,  tau = sapo_temperature_pos if A > 0 else _neg
    vespo     -phi A lp, phi = e^lambda w_s^k e^(-lambda w_s) (detached), w_s = exp of the completion's
              summed clamped log_ratio (+ the sampler's log IS ratios), k, lambda by the sign of A

then times the off-policy mask (a completion with A < 0 whose mean (sampler - lp) exceeds the
threshold: 0), the entropy mask (tokens below the (1 - top_entropy_quantile) quantile of the batch's
entropies: 0) and the sampler's importance-sampling ratio (all but vespo), plus beta x the k3 KL
(times w when use_bias_correction_kl). Stats: sums for TRL's metrics, per token or (level sequence,
or vespo's phi) per completion; and the least / most over the completions of each one's clipped
share (clip_low_min, clip_high_max: engine.stats MIN / MAX, NaN where no completion has a token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...config.schema import RLConfig

CLIPPED = ("grpo", "dr_grpo", "dapo", "bnpo", "luspo")


@dataclass
class Flat:
    """A step's labelled tokens laid flat: the policy's log-probs (differentiable), the rollout
    policy's, each token's completion (an index into the rows) and advantage; per row its advantage
    and whether it is a real completion (1.0; an eval rank's filler: 0.0); optionally per token the
    entropy (top_entropy_quantile < 1), the sampler's log-probs and the IS ratio (a sampler apart)."""

    lp: torch.Tensor
    old: torch.Tensor
    row: torch.Tensor
    adv: torch.Tensor
    row_adv: torch.Tensor
    real: torch.Tensor
    entropy: torch.Tensor | None = None
    sampling: torch.Tensor | None = None
    is_ratio: torch.Tensor | None = None

    def row_sum(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.row_adv.shape[0], dtype=x.dtype, device=x.device).index_add(0, self.row, x)

    def row_count(self) -> torch.Tensor:
        return self.row_sum(torch.ones_like(self.lp.detach()))


def policy_loss(cfg: RLConfig, f: Flat) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(per-token policy loss (n,) with the masks and IS ratio applied, the importance weight w
    per token (n,) for the KL's bias correction, stats)."""
    eps_low = cfg.epsilon
    eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    log_ratio = f.lp - f.old
    seq = cfg.importance_sampling_level == "sequence"
    if seq:  # one weight per completion: (R,), the advantages per row
        w = torch.exp(f.row_sum(log_ratio) / f.row_count().clamp(min=1.0))
        a, spread = f.row_adv, (lambda u: u[f.row])
    else:
        w = torch.exp(log_ratio)
        a, spread = f.adv, (lambda u: u)
    stats: dict[str, torch.Tensor] = {}

    def count(flag: torch.Tensor) -> torch.Tensor:
        return (flag.float() * f.real).sum() if seq else flag.float().sum()

    lt = cfg.loss_type
    if lt == "cispo":
        per = -spread(torch.clamp(w, max=eps_high).detach() * a) * f.lp
        stats["cispo_clip"] = count((w.detach() > eps_high) & (a > 0))
    elif lt in CLIPPED:
        w2 = torch.clamp(w, 1 - eps_low, 1 + eps_high)
        w1 = w if cfg.delta is None else torch.clamp(w, max=cfg.delta)
        per = spread(-torch.min(w1 * a, w2 * a))
        c = w1.detach()
        low, high = (c < 1 - eps_low) & (a < 0), (c > 1 + eps_high) & (a > 0)
        stats |= {"clip_low": count(low), "clip_high": count(high), "clip_region": count(low | high)}
        # TRL's clip_ratio/low_min, /high_max: the least / most over completions of each one's share
        stats |= {
            "clip_low_min": nanmin(per_completion(f, low, seq)),
            "clip_high_max": nanmax(per_completion(f, high, seq)),
        }
    elif lt == "sapo":
        tau = torch.where(
            a > 0,
            torch.full_like(a, cfg.sapo_temperature_pos),
            torch.full_like(a, cfg.sapo_temperature_neg),
        )
        per = spread(-(torch.sigmoid(tau * (w - 1)) * 4 / tau) * a)
    elif lt == "vespo":
        phi = gamma_weights(cfg, f, log_ratio.detach())
        per = -(phi * f.row_adv)[f.row] * f.lp
        stats["vespo_phi"] = (phi * f.real).sum()
    else:
        raise ValueError(f"rl.loss_type: unknown {lt!r}")
    if cfg.off_policy_mask_threshold is not None:
        per = per * off_policy_mask(f, cfg.off_policy_mask_threshold)[f.row]
    if cfg.top_entropy_quantile < 1.0:
        per = per * high_entropy_mask(f.entropy, cfg.top_entropy_quantile)
    if f.is_ratio is not None and lt != "vespo":
        per = per * f.is_ratio
    return per, spread(w), stats


@torch.no_grad()
def per_completion(f: Flat, flag: torch.Tensor, seq: bool) -> torch.Tensor:
    """Each completion's share of flagged tokens (R,) (TRL's masked_seq_mean): at level sequence the
    flag itself (one per completion, as TRL); per token NaN for a completion without labelled
    tokens (0 / 0); NaN for an eval rank's filler."""
    v = flag.float() if seq else f.row_sum(flag.float()) / f.row_count()  # 0 / 0: NaN
    return torch.where(f.real > 0, v, torch.full_like(v, math.nan))


def nanmin(v: torch.Tensor) -> torch.Tensor:
    """The least of v leaving NaN out, NaN when all are (TRL's nanmin); no device sync."""
    if not v.numel():
        return torch.tensor(math.nan, device=v.device)
    m = torch.where(torch.isnan(v), torch.full_like(v, math.inf), v).amin()
    return torch.where(torch.isinf(m), torch.full_like(m, math.nan), m)  # the values here are finite


def nanmax(v: torch.Tensor) -> torch.Tensor:
    return -nanmin(-v)


@torch.no_grad()
def gamma_weights(cfg: RLConfig, f: Flat, log_ratio: torch.Tensor) -> torch.Tensor:
    """VESPO's phi per completion (R,), as TRL's GRPOTrainer.get_gamma_weights."""
    lower = math.log(1e-8)
    seq_log = f.row_sum(torch.clamp(log_ratio, -20.0, 20.0))
    if f.is_ratio is not None:
        seq_log = seq_log + f.row_sum(torch.clamp(torch.log(f.is_ratio), lower, 20.0))
    log_w = torch.clamp(seq_log, lower, 20.0)
    pos = f.row_adv >= 0
    k = torch.where(pos, torch.full_like(log_w, cfg.vespo_k_pos), torch.full_like(log_w, cfg.vespo_k_neg))
    lam = torch.where(
        pos, torch.full_like(log_w, cfg.vespo_lambda_pos), torch.full_like(log_w, cfg.vespo_lambda_neg)
    ).clamp(min=1e-4)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@torch.no_grad()
def off_policy_mask(f: Flat, threshold: float) -> torch.Tensor:
    """Per completion (R,) 1.0 to keep, 0.0 to drop: A >= 0 or the mean over its tokens of
    (sampler's, else the rollout policy's, log-prob - the policy's) <= threshold (TRL's OPSM)."""
    sampling = f.old if f.sampling is None else f.sampling
    kl = torch.nan_to_num(sampling - f.lp.detach(), nan=0.0)
    avg = f.row_sum(kl) / f.row_count().clamp(min=1.0)
    return ((f.row_adv >= 0) | (avg <= threshold)).float()


@torch.no_grad()
def high_entropy_mask(entropy: torch.Tensor | None, quantile: float) -> torch.Tensor:
    """1.0 where a token's entropy is at or above the (1 - quantile) quantile of the batch's (TRL's
    get_high_entropy_mask over the step's labelled tokens), else 0.0."""
    assert entropy is not None, "top_entropy_quantile < 1 needs the entropies (GRPOObjective.first_pass)"
    if not entropy.numel():
        return torch.zeros_like(entropy)
    return (entropy >= torch.quantile(entropy.float(), 1 - quantile)).float()
