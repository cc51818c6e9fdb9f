"""Advantages and reward metrics of one step's rollouts, as TRL 1.16's GRPOTrainer computes them
(`_generate_and_score_completions`, multi_objective_aggregation "sum_then_normalize"):

    r_i        sum over the reward functions of weight x value (None values left out); NaN when
               every function returned None (unscorable)
    mean       the group's mean of r (NaN left out), each group G consecutive completions
    std        the group's (group, none) or the batch's (batch) sample std of r (n - 1, NaN left out)
    advantage  r - mean, divided by (std + 1e-4) unless scale_rewards is none; NaN -> 0

Metrics (TRL's names): reward, reward_std (of r over the batch), rewards/<name>/mean and /std,
frac_reward_zero_std (the share of completions whose std is 0).
"""

from __future__ import annotations

import math

import torch


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sample standard deviation (n - 1) of the non-NaN values; NaN where fewer than two (TRL's
    nanstd: not sqrt(0 / -1) = -0.0)."""
    keep = ~torch.isnan(x)
    n = keep.sum() if dim is None else keep.sum(dim)
    mean = torch.nanmean(x) if dim is None else torch.nanmean(x, dim=dim, keepdim=True)
    sq = torch.where(keep, (x - mean) ** 2, 0.0)
    s = sq.sum() if dim is None else sq.sum(dim)
    return torch.where(n > 1, torch.sqrt(s / (n - 1).clamp(min=1)), math.nan)


def advantages(
    per_func: torch.Tensor, weights: torch.Tensor, G: int, scale: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """per_func (n, F) fp32 (NaN: None) -> (advantages (n,), rewards r (n,), std is zero (n,) bool)."""
    unscorable = torch.isnan(per_func).all(dim=1)
    r = (per_func * weights[None, :]).nansum(dim=1)
    r[unscorable] = math.nan
    grouped = r.view(-1, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(G)
    if scale == "batch":
        std = nanstd(r).expand_as(r) if r.numel() > 1 else torch.zeros_like(r)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(G)
    adv = r - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    zero = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(adv, nan=0.0), r, zero


def reward_metrics(per_func: torch.Tensor, names: list[str], r: torch.Tensor, zero: torch.Tensor) -> dict:
    out: dict = {}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = _num(torch.nanmean(per_func[:, i]))
        out[f"rewards/{name}/std"] = _num(nanstd(per_func[:, i]))
    out["reward"] = _num(torch.nanmean(r))
    out["reward_std"] = _num(nanstd(r))
    out["frac_reward_zero_std"] = zero.float().mean().item()
    return out


def _num(x: torch.Tensor) -> float | None:
    v = float(x)
    return v if math.isfinite(v) else None
