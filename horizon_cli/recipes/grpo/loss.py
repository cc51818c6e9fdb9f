"""GRPO on the objective seam (engine.objective), with TRL 1.16's GRPOTrainer formula
(trl/trainer/grpo_trainer.py, `_compute_loss`, importance_sampling_level "token").

A micro-batch holds whole completions: each row a prompt and one sampled completion, labels on
the completion's tokens (rl.rollouts; a truncated completion under mask_truncated_completions has
none). Per labelled token, with lp its log-prob under the policy (logits / rl.temperature, as
TRL scores them), old the rollout policy's (GRPOPayload.old; lp itself, detached, when
num_iterations is 1, as TRL does) and A its completion's advantage (GRPOPayload.adv):

    coef_1 = exp(lp - old),  coef_2 = clamp(coef_1, 1 - epsilon, 1 + epsilon_high)
    loss_t = -min(coef_1 A, coef_2 A)  + beta (exp(ref - lp) - (ref - lp) - 1)   (k3, when beta > 0)

aggregated by loss_type over the step's whole batch (batch_size x G completions, however the
micro-batches split it; TRL's with every completion in one accumulated batch):

    grpo      the mean over completions of each completion's token mean      divisor: completions
    dr_grpo   the token sum / (completions x max_completion_length)          divisor: that product
    dapo      the token sum / the batch's active tokens                      divisor: tokens
    bnpo      as dapo (TRL normalises by a device batch's tokens; here the batch is the step's)

`loss` returns the sum the divisor divides. Stats (sums over this rank's tokens): tokens, kl
(of the per-token KL, when beta > 0), clip_low / clip_high / clip_region (TRL's clipped-ratio
counts: coef_1 below 1 - epsilon with A < 0, above 1 + epsilon_high with A > 0).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...config.schema import RLConfig
from ...data.batch import IGNORE, MicroBatch
from ...engine.objective import Head, HeadOut, SequenceObjective, Targets
from ...engine.seams import Stats

STATS = ("tokens", "kl", "clip_low", "clip_high", "clip_region")


@dataclass
class GRPOPayload:
    """A micro-batch of completions' payload: each row's advantage (b,) fp32 and the real rows (an
    eval rank's filler: 0); per labelled token the rollout policy's log-probs (num_iterations > 1)
    and the reference's (beta > 0), filled in after the rollout (recipes.grpo.batches), else None."""

    adv: torch.Tensor
    rows: int
    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None

    def unlabelled(self) -> GRPOPayload:
        return replace(self, rows=0)


def payload_of(mb: MicroBatch) -> GRPOPayload:
    if not isinstance(mb.payload, GRPOPayload):
        raise ValueError("an rl micro-batch carries its completions' advantages (GRPOPayload)")
    return mb.payload


@dataclass
class GRPOTargets(Targets):
    """One micro-batch's completion tokens: per token its advantage, its row's token count (as a
    float), and the rollout policy's and the reference's log-probs (None when not needed)."""

    adv: torch.Tensor
    row_len: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None


class GRPOObjective(SequenceObjective):
    name = "rl"
    needs_reference = False  # the reference of an rl run is per step (rl.batches), not precomputed

    def __init__(self, cfg: RLConfig):
        self.cfg = cfg
        self.eps_low = cfg.epsilon
        self.eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high

    def divisor(self, mbs: list[MicroBatch]) -> int:
        rows = sum(payload_of(mb).rows for mb in mbs)
        if self.cfg.loss_type == "grpo":
            return rows
        if self.cfg.loss_type == "dr_grpo":
            return rows * self.cfg.max_completion_length
        return max(1, sum(mb.label_tokens for mb in mbs))

    def targets(self, mbs: list[MicroBatch], device: torch.device) -> list[Targets]:
        out: list[Targets] = []
        for mb in mbs:
            _, T = mb.input_ids.shape
            lab = mb.labels[:, 1:] != IGNORE
            idx = lab.reshape(-1).nonzero().squeeze(1)
            seq = idx // max(T - 1, 1)
            per_row = lab.sum(1).clamp(min=1).float()
            pay = payload_of(mb)
            old, ref = pay.old, pay.ref
            if not idx.numel():  # no labels (an eval rank's pad, MicroBatch.unlabelled): no log-probs
                old, ref = (None if v is None else v[:0] for v in (old, ref))
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
                )
            )
        return out

    def loss(self, logps: list[torch.Tensor], targets: list[Targets]) -> tuple[torch.Tensor, Stats]:
        ts: list[GRPOTargets] = targets  # type: ignore[assignment]
        lp = torch.cat(logps)
        adv = torch.cat([t.adv for t in ts])
        old = torch.cat(
            [t.old if t.old is not None else lp_m.detach() for lp_m, t in zip(logps, ts, strict=True)]
        )
        coef_1 = torch.exp(lp - old)
        coef_2 = torch.clamp(coef_1, 1 - self.eps_low, 1 + self.eps_high)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        stats: dict[str, torch.Tensor] = {"tokens": torch.tensor(float(lp.numel()), device=lp.device)}
        if self.cfg.beta > 0:
            ref = torch.cat([t.ref for t in ts])  # type: ignore[misc]
            kl = torch.exp(ref - lp) - (ref - lp) - 1
            per_token = per_token + self.cfg.beta * kl
            stats["kl"] = kl.detach().sum()
        if self.cfg.loss_type == "grpo":
            per_token = per_token / torch.cat([t.row_len for t in ts])
        c = coef_1.detach()
        low = (c < 1 - self.eps_low) & (adv < 0)
        high = (c > 1 + self.eps_high) & (adv > 0)
        stats |= {
            "clip_low": low.float().sum(),
            "clip_high": high.float().sum(),
            "clip_region": (low | high).float().sum(),
        }
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
