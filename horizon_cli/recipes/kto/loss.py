"""KTO (unpaired preference) on the objective seam (engine.objective), with TRL's KTOTrainer
formula (trl/trainer/kto_trainer.py, `_compute_loss`, loss_type "kto").

A micro-batch holds whole examples: rows 2j and 2j + 1 are example j's prompt + its completion and
its prompt + a mismatched completion (data.unpaired), labels on the completions. With pi a row's
summed log-prob and ref the reference's (data.unpaired.KTOPayload.ref, the streamed reference pass):

    kl     = max(0, mean over the global batch's mismatched rows of (pi - ref)), detached: TRL
             computes those rows under no_grad, averages them per device, gathers the devices'
             means and averages them, clamped at 0 (equal per-device batches: the global mean)
    r      = pi - ref of the example's own completion
    loss   = desirable_weight (1 - s(beta (r - kl)))     for a desirable example
             undesirable_weight (1 - s(beta (kl - r)))   for an undesirable one

The step loss is the mean over the global batch's examples (TRL: losses.nanmean() of a batch). The
mismatched rows get no gradient (their coefficients are zero). `all_sum`, when set, sums the KL
numerator over the ranks in place (a collective every rank calls in the head step and in an eval
batch, whose ranks are padded to the same micro-batches; engine.parts sets it through
`across_ranks` on more than one rank); unset, this rank's micro-batches are the global batch.

Stats (sums over this rank's examples; TRL logs each over its count): rewards_chosen / _rejected
(beta r of the desirable / undesirable examples), logps_chosen / _rejected (pi), count_chosen /
_rejected, and kl (the batch's KL estimate times this rank's examples: summed over ranks and
divided by the examples, TRL's `kl`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from ...config.schema import PreferenceConfig
from ...data.batch import IGNORE, MicroBatch
from ...data.unpaired import KTOPayload
from ...engine.objective import SequenceObjective, Targets

STATS = (
    "rewards_chosen",
    "rewards_rejected",
    "logps_chosen",
    "logps_rejected",
    "count_chosen",
    "count_rejected",
    "kl",
)


@dataclass
class KTOTargets(Targets):
    """One micro-batch of examples: per position its row (n,); per row its reference log-prob
    (b,); per example whether it is desirable and real (b/2,); the global batch's examples."""

    seq: torch.Tensor
    ref: torch.Tensor
    desirable: torch.Tensor
    valid: torch.Tensor
    examples: float


class KTOObjective(SequenceObjective):
    name = "preference"
    needs_reference = True

    def __init__(self, cfg: PreferenceConfig, all_sum: Callable[[torch.Tensor], None] | None = None):
        self.cfg, self.all_sum = cfg, all_sum

    def across_ranks(self, all_sum: Callable[[torch.Tensor], None]) -> None:
        self.all_sum = all_sum

    def divisor(self, mbs: list[MicroBatch]) -> int:
        """The global batch's examples (those whose completion row has a label)."""
        return sum(int(_valid(mb.labels).sum()) for mb in mbs)

    def targets(self, mbs: list[MicroBatch], device: torch.device) -> list[Targets]:
        out: list[Targets] = []
        for mb in mbs:
            b, T = mb.input_ids.shape
            if b % 2:
                raise ValueError("a micro-batch of KTO examples has an even number of rows")
            pay = mb.payload
            if not isinstance(pay, KTOPayload) or pay.ref is None:
                raise ValueError("preference.loss kto needs reference log-probs in the batch")
            ref = pay.ref
            idx = (mb.labels[:, 1:] != IGNORE).reshape(-1).nonzero().squeeze(1)
            valid = _valid(mb.labels)
            t = KTOTargets(
                idx=idx.to(device),
                tgt=mb.input_ids[:, 1:].reshape(-1)[idx].to(device),
                seq=(idx // max(T - 1, 1)).to(device),
                ref=ref.float().to(device),
                desirable=pay.desirable.bool().to(device),
                valid=valid.to(device),
                examples=float(pay.examples),
            )
            out.append(t)
        return out

    def loss(
        self, logps: list[torch.Tensor], targets: list[Targets]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ts = cast(list[KTOTargets], targets)  # made by self.targets
        sums = [
            torch.zeros(t.ref.shape[0], dtype=lp.dtype, device=lp.device).index_add(0, t.seq, lp)
            for lp, t in zip(logps, ts, strict=True)
        ]
        pi = torch.cat([s[0::2] for s in sums])
        pi_kl = torch.cat([s[1::2] for s in sums]).detach()  # TRL: under no_grad
        ref = torch.cat([t.ref[0::2] for t in ts])
        ref_kl = torch.cat([t.ref[1::2] for t in ts])
        valid = torch.cat([t.valid for t in ts])
        des = torch.cat([t.desirable for t in ts]) & valid
        und = ~des & valid
        kl_sum = torch.where(valid, pi_kl - ref_kl, 0.0).sum()
        if self.all_sum is not None:
            kl_sum = kl_sum.detach().clone()
            self.all_sum(kl_sum)
        kl = (kl_sum / max(ts[0].examples, 1.0)).clamp(min=0).detach()
        beta, cfg = self.cfg.beta, self.cfg
        r = torch.where(valid, pi, ref) - ref  # fillers: finite stand-ins
        losses = torch.where(
            des,
            cfg.desirable_weight * (1 - torch.sigmoid(beta * (r - kl))),
            cfg.undesirable_weight * (1 - torch.sigmoid(beta * (kl - r))),
        )
        total = torch.where(valid, losses, 0.0).sum()
        rew, lp = beta * r.detach(), pi.detach()
        stats = {
            "rewards_chosen": torch.where(des, rew, 0.0).sum(),
            "rewards_rejected": torch.where(und, rew, 0.0).sum(),
            "logps_chosen": torch.where(des, lp, 0.0).sum(),
            "logps_rejected": torch.where(und, lp, 0.0).sum(),
            "count_chosen": des.float().sum(),
            "count_rejected": und.float().sum(),
            "kl": kl * valid.float().sum(),
        }
        return total, stats


def _valid(labels: torch.Tensor) -> torch.Tensor:
    """(b,) labels -> (b/2,) bool: the example's completion row has a label after the shift."""
    return (labels[0::2, 1:] != IGNORE).any(1)
