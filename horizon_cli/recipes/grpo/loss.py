"""GRPO on the objective seam (engine.objective), with TRL 1.16's GRPOTrainer formula
(trl/trainer/grpo_trainer.py, `_compute_loss`).

A micro-batch holds whole completions: each row a prompt and one sampled completion, labels on
the completion's tokens (rl.rollouts; a truncated completion under mask_truncated_completions has
none). Per labelled token, with lp its log-prob under the policy (logits / rl.temperature, as
TRL scores them), old the rollout policy's (GRPOPayload.old; lp itself, detached, when
num_iterations is 1, as TRL does) and A its completion's advantage (GRPOPayload.adv), the policy
term of each loss_type, its masks and the sampler's importance ratio are recipes.grpo.policy's;
here the k3 KL (beta > 0; times the importance weight when use_bias_correction_kl):

    loss_t = policy_t + beta (exp(ref - lp) - (ref - lp) - 1)

aggregated by loss_type over the step's whole batch (batch_size x G completions, however the
micro-batches split it; TRL's with every completion in one accumulated batch):

    grpo, sapo         the mean over completions of each completion's token mean   divisor: completions
    luspo              the mean over completions of each completion's token sum    divisor: completions
    dr_grpo            the token sum / (completions x max_completion_length)       divisor: that product
    dapo, cispo, vespo the token sum / the batch's active tokens                   divisor: tokens
    bnpo               as dapo (TRL normalises by a device batch's tokens; here the batch is the step's)

`loss` returns the sum the divisor divides. Stats (sums over this rank's data): tokens, rows (real
completions), entropy (of each token's distribution, the head's first pass: TRL's `entropy`), kl
(of the per-token KL, when beta > 0), and policy's: clip_low / clip_high / clip_region (TRL's
clipped-ratio counts), cispo_clip, vespo_phi; and two that are not sums (REDUCTIONS, engine.stats):
clip_low_min, clip_high_max, the least / most over the completions of each one's clipped share.
token_means and ratio_metrics turn them into TRL's metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import cast

import torch

from ...config.schema import RLConfig
from ...data.batch import IGNORE, MicroBatch
from ...engine.objective import Head, HeadOut, SequenceObjective, Targets
from ...engine.seams import Stats
from ...engine.stats import Kinds, Reduction
from .policy import Flat, policy_loss

STATS = ("tokens", "rows", "entropy", "kl", "clip_low", "clip_high", "clip_region", "cispo_clip", "vespo_phi")
REDUCTIONS: Kinds = {"clip_low_min": Reduction.MIN, "clip_high_max": Reduction.MAX}  # TRL's nanmin / nanmax
PER_COMPLETION = ("grpo", "sapo", "luspo")  # divided by the completions


@dataclass
class GRPOPayload:
    """A micro-batch of completions' payload: each row's advantage (b,) fp32 and the real rows (an
    eval rank's filler: 0); per labelled token the rollout policy's log-probs (num_iterations > 1)
    and the reference's (beta > 0), filled in after the rollout (recipes.grpo.batches), else None."""

    adv: torch.Tensor
    rows: int
    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    sampling: torch.Tensor | None = None  # the sampler's log-probs (a sampler apart from the weights)
    is_ratio: torch.Tensor | None = None  # its importance-sampling ratio (recipes.grpo.sampling)

    def unlabelled(self) -> GRPOPayload:
        return replace(self, rows=0)


def payload_of(mb: MicroBatch) -> GRPOPayload:
    if not isinstance(mb.payload, GRPOPayload):
        raise ValueError("an rl micro-batch carries its completions' advantages (GRPOPayload)")
    return mb.payload


@dataclass
class GRPOTargets(Targets):
    """One micro-batch's completion tokens: per token its advantage, its row's token count (as a
    float), its row in the micro-batch, and the rollout policy's and the reference's log-probs (None
    when not needed); per row its advantage and whether it is a real completion; the entropies
    (top_entropy_quantile < 1), filled in by the head's first pass."""

    adv: torch.Tensor
    row_len: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None
    row: torch.Tensor | None = None
    row_adv: torch.Tensor | None = None
    real: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    sampling: torch.Tensor | None = None
    is_ratio: torch.Tensor | None = None


class GRPOObjective(SequenceObjective):
    name = "rl"
    reductions = REDUCTIONS
    needs_reference = False  # the reference of an rl run is per step (rl.batches), not precomputed

    def __init__(self, cfg: RLConfig):
        self.cfg = cfg

    def divisor(self, mbs: list[MicroBatch]) -> int:
        rows = sum(payload_of(mb).rows for mb in mbs)
        if self.cfg.loss_type in PER_COMPLETION:
            return rows
        if self.cfg.loss_type == "dr_grpo":
            return rows * self.cfg.max_completion_length
        return max(1, sum(mb.label_tokens for mb in mbs))

    def targets(self, mbs: list[MicroBatch], device: torch.device) -> list[Targets]:
        out: list[Targets] = []
        for mb in mbs:
            b, T = mb.input_ids.shape
            lab = mb.labels[:, 1:] != IGNORE
            idx = lab.reshape(-1).nonzero().squeeze(1)
            seq = idx // max(T - 1, 1)
            per_row = lab.sum(1).clamp(min=1).float()
            pay = payload_of(mb)
            old, ref, smp, isr = pay.old, pay.ref, pay.sampling, pay.is_ratio
            if not idx.numel():  # no labels (an eval rank's pad, MicroBatch.unlabelled): no log-probs
                old, ref, smp, isr = (None if v is None else v[:0] for v in (old, ref, smp, isr))
            if self.cfg.beta > 0 and ref is None:
                raise ValueError("rl.beta > 0 needs the reference's log-probs in the batch")
            out.append(
                GRPOTargets(
                    idx=idx.to(device),
                    tgt=mb.input_ids[:, 1:].reshape(-1)[idx].to(device),
                    adv=pay.adv.float()[seq].to(device),
                    row_len=per_row[seq].to(device),
                    old=None if old is None else old.float().to(device),
                    ref=None if ref is None or self.cfg.beta == 0 else ref.float().to(device),
                    row=seq.to(device),
                    row_adv=pay.adv.float()[:b].to(device),
                    real=(torch.arange(b) < pay.rows).float().to(device),
                    sampling=None if smp is None else smp.float().to(device),
                    is_ratio=None if isr is None else isr.float().to(device),
                )
            )
        return out

    def first_pass(self, head: Head, x: torch.Tensor, t: Targets) -> torch.Tensor:
        """The log-probs and each token's entropy (kept in t: TRL's `entropy` metric, and the mask of
        top_entropy_quantile < 1), in the same chunks of the head."""
        assert isinstance(t, GRPOTargets)  # this objective's own (targets())
        lp, t.entropy = head.logps_entropies(x, t)
        return lp

    def loss(self, logps: list[torch.Tensor], targets: list[Targets]) -> tuple[torch.Tensor, Stats]:
        ts = cast(list[GRPOTargets], targets)  # this objective's own (targets())
        lp = torch.cat(logps)
        f = flat(lp, logps, ts)
        per_token, w, stats = policy_loss(self.cfg, f)
        stats["tokens"] = torch.tensor(float(lp.numel()), device=lp.device)
        stats["rows"] = f.real.sum()
        if f.entropy is not None:  # every first pass keeps them
            stats["entropy"] = f.entropy.sum()
        if self.cfg.beta > 0:
            ref = whole([t.ref for t in ts])
            kl = torch.exp(ref - lp) - (ref - lp) - 1
            if self.cfg.use_bias_correction_kl:
                kl = kl * w
            per_token = per_token + self.cfg.beta * kl
            stats["kl"] = kl.detach().sum()
        if self.cfg.loss_type in ("grpo", "sapo"):
            per_token = per_token / torch.cat([t.row_len for t in ts])
        return per_token.sum(), stats

    def train(self, head: Head, xs: list[torch.Tensor], targets: list[Targets], inv: float) -> HeadOut:
        return super().train(self.scaled(head), xs, targets, inv)

    def evaluate(
        self, head: Head, xs: list[torch.Tensor], targets: list[Targets]
    ) -> tuple[torch.Tensor, Stats]:
        return super().evaluate(self.scaled(head), xs, targets)

    def scaled(self, head: Head) -> Head:
        """The head with its logits divided by rl.temperature (TRL scores completions so)."""
        return scaled_head(head, self.cfg.temperature)


def scaled_head(head: Head, temperature: float) -> Head:
    if temperature == 1.0:
        return head
    inner = head.logits
    return replace(head, logits=lambda x, lm: inner(x, lm) / temperature)


def whole(parts: list[torch.Tensor | None]) -> torch.Tensor:
    """The micro-batches' parts of a field every one of them has, concatenated."""
    have = [p for p in parts if p is not None]
    assert len(have) == len(parts), "a micro-batch without the field"
    return torch.cat(have)


def flat(lp: torch.Tensor, logps: list[torch.Tensor], ts: list[GRPOTargets]) -> Flat:
    """The step's tokens laid flat (policy.Flat): rows numbered across the micro-batches; `old` the
    rollout policy's log-probs, or the policy's own, detached (num_iterations 1, as TRL)."""
    rows, at = [], 0
    for t in ts:
        assert t.row is not None and t.row_adv is not None
        rows.append(t.row + at)
        at += t.row_adv.shape[0]
    ents = [t.entropy for t in ts]

    def each(vs: list) -> torch.Tensor | None:
        return None if any(v is None for v in vs) else torch.cat(vs)

    return Flat(
        lp=lp,
        old=torch.cat([t.old if t.old is not None else m.detach() for m, t in zip(logps, ts, strict=True)]),
        row=torch.cat(rows),
        adv=torch.cat([t.adv for t in ts]),
        row_adv=whole([t.row_adv for t in ts]),
        real=whole([t.real for t in ts]),
        entropy=each(ents),
        sampling=each([t.sampling for t in ts]),
        is_ratio=each([t.is_ratio for t in ts]),
    )


def token_means(rl: RLConfig, stats: dict[str, float]) -> dict[str, float | None]:
    """TRL's per-token means of a step or an evaluation: entropy, kl (beta > 0)."""
    toks = stats.get("tokens", 0.0)
    out: dict[str, float | None] = {}
    if "entropy" in stats:
        out["entropy"] = stats["entropy"] / toks if toks else None
    if rl.beta > 0:
        out["kl"] = stats["kl"] / toks if toks else None
    return out


def ratio_metrics(rl: RLConfig, stats: dict[str, float]) -> dict[str, float | None]:
    """TRL's ratio metrics of a training step from the loss's stats: clip_ratio/{low,high,region}_mean
    (the clipped losses) or cispo_clip_ratio, per token or (importance_sampling_level sequence) per
    completion, and clip_ratio/low_min, /high_max (over completions); vespo/phi_seq_mean per completion."""
    units = stats.get("rows" if rl.importance_sampling_level == "sequence" else "tokens", 0.0)
    rows = stats.get("rows", 0.0)
    out: dict[str, float | None] = {}
    if "clip_low" in stats:  # at num_iterations 1 too (ratio 1: 0), as TRL logs them
        for k in ("low", "high", "region"):
            out[f"clip_ratio/{k}_mean"] = stats[f"clip_{k}"] / units if units else None
        for k in ("low_min", "high_max"):  # over completions (NaN: none had a token)
            v = stats.get(f"clip_{k}", math.nan)
            out[f"clip_ratio/{k}"] = None if math.isnan(v) else v
    if "cispo_clip" in stats:
        out["cispo_clip_ratio"] = stats["cispo_clip"] / units if units else None
    if "vespo_phi" in stats:
        out["vespo/phi_seq_mean"] = stats["vespo_phi"] / rows if rows else None
    return out
