"""The importance-sampling correction between a sampler and the policy, as TRL 1.16's
GRPOTrainer computes it in `_generate_and_score_completions` (`vllm_importance_sampling_*`) and
applies it in `_compute_loss` (recipes.grpo.policy: the per-token loss times the ratio; vespo folds
it into its gamma weight).

When the rollouts carry the sampler's per-token log-probs (`sampling`: a sampler whose weights are
not the trained ones, e.g. a quantized resident copy), with old the rollout policy's log-probs on
the trained weights, per completion token:

    d = nan_to_num(old - sampling)         ratio = exp(d) (token_*) or exp(sum of d over the completion) (sequence_*)
    *_truncate: clamp(ratio, clip_min, clip_max);   *_mask: ratio outside [clip_min, clip_max] -> 0

Today's streamed sampler decodes from the trained weights themselves: its rollouts carry no
sampling log-probs (they would equal old), and nothing here runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ...config.schema import RLConfig
from ...data.batch import IGNORE, MicroBatch
from .loss import payload_of


def importance_ratio(
    rl: RLConfig, old: torch.Tensor, sampling: torch.Tensor, row: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the ratio per token (n,), the ratios TRL's metrics read: per token, or per completion (rows,)
    for the sequence modes). old, sampling (n,) over the batch's completion tokens, row their
    completion's index."""
    diff = torch.nan_to_num(old - sampling, nan=0.0)
    seq = rl.importance_sampling_mode.startswith("sequence")
    if seq:
        diff = torch.zeros(rows, dtype=diff.dtype, device=diff.device).index_add(0, row, diff)
    ratio = torch.exp(diff)
    lo, hi = rl.importance_sampling_clip_min, rl.importance_sampling_clip_max
    if rl.importance_sampling_mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=lo, max=hi)
    else:
        lo_v = -math.inf if lo is None else lo
        hi_v = math.inf if hi is None else hi
        ratio = ratio.masked_fill((ratio < lo_v) | (ratio > hi_v), 0.0)
    return (ratio[row] if seq else ratio), ratio


def sampling_metrics(old: torch.Tensor, sampling: torch.Tensor, unit: torch.Tensor) -> dict[str, float]:
    """TRL's sampling/ metrics: the sampler-policy log-prob gap (mean, max over the tokens it could
    score) and the importance ratio's min, mean, max (`unit`: per token or per completion)."""
    gap = torch.abs(old - sampling)
    gap = gap[~torch.isnan(gap)]

    def of(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> float:
        return float(fn(x)) if x.numel() else 0.0

    return {
        "sampling/sampling_logp_difference/mean": of(gap, torch.mean),
        "sampling/sampling_logp_difference/max": of(gap, torch.max),
        "sampling/importance_sampling_ratio/min": of(unit, torch.min),
        "sampling/importance_sampling_ratio/mean": of(unit, torch.mean),
        "sampling/importance_sampling_ratio/max": of(unit, torch.max),
    }


def correct(rl: RLConfig, mbs: list[MicroBatch]) -> dict[str, float]:
    """Each micro-batch's GRPOPayload.is_ratio from its `old` and `sampling` log-probs (label order),
    over the whole batch at once (the sequence modes' sums are per completion); -> TRL's metrics."""
    olds, samps, rows, sizes, at = [], [], [], [], 0
    for mb in mbs:
        pay = payload_of(mb)
        b, T = mb.input_ids.shape
        idx = (mb.labels[:, 1:] != IGNORE).reshape(-1).nonzero().squeeze(1)
        assert pay.old is not None and pay.sampling is not None
        olds.append(pay.old.float())
        samps.append(pay.sampling.float())
        rows.append(idx // max(T - 1, 1) + at)
        sizes.append(idx.numel())
        at += b
    old, sampling, row = torch.cat(olds), torch.cat(samps), torch.cat(rows)
    ratio, unit = importance_ratio(rl, old, sampling, row, at)
    for mb, r in zip(mbs, torch.split(ratio, sizes), strict=True):
        payload_of(mb).is_ratio = r
    return sampling_metrics(old, sampling, unit)
