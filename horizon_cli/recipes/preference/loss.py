"""Preference objectives on the objective seam (engine.objective): DPO, IPO, SimPO and ORPO, each
a function of per-token log-probs, with TRL's formulas.

A micro-batch holds whole pairs: rows 2j and 2j + 1 are pair j's prompt + chosen and prompt +
rejected, labels on the completions (data.pairs). With pi = a completion's summed log-prob, n its
predicted tokens, ref the reference's pi (data.pairs.PairPayload.ref, engine.infer's reference pass):

    dpo    DPOTrainer loss_type sigmoid: x = (pi_c - ref_c) - (pi_r - ref_r); -log s(beta x)
           (TRL 1.16's sigmoid ignores label_smoothing; config.preference refuses it with dpo)
    cdpo   conservative DPO on the same x: -(1 - ls) log s(beta x) - ls log s(-beta x), ls =
           label_smoothing (the sigmoid loss TRL's DPOTrainer had before 1.x, CPOTrainer's
           sigmoid formula applied to the log-ratios)
    ipo    DPOTrainer loss_type ipo: ((pi_c - ref_c) / L_c - (pi_r - ref_r) / L_r - 1 / (2 beta))^2,
           L the completion's tokens (TRL's completion_mask sum)
    simpo  CPOTrainer loss_type simpo, cpo_alpha 0: x = pi_c / n_c - pi_r / n_r - gamma / beta;
           -(1 - ls) log s(beta x) - ls log s(-beta x)
    orpo   ORPOTrainer: NLL of the chosen sequences (every predicted token, prompt included, as TRL
           computes it: a token mean over the global batch) - beta log s(log-odds), log-odds =
           (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r)), a = pi / n

plus sft_weight x the chosen completions' mean NLL (a token mean over the global batch; TRL's
rpo_alpha, DPOTrainer loss_type sft). The step loss is the mean over the global batch's pairs;
the global token counts come with the batch (PairPayload), so micro-batches and ranks add up to it.

Stats (sums over this rank's pairs, as TRL logs them): rewards_chosen / _rejected = beta (pi -
ref) (reference-free losses: beta a), rewards_margin, rewards_accuracy (chosen's reward above
rejected's), logps_chosen / _rejected (pi; reference-free: a, as CPO/ORPOTrainer log them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from ...config.schema import REFERENCED, PreferenceConfig
from ...data.batch import IGNORE, MicroBatch
from ...data.pairs import PairPayload
from ...engine.objective import SequenceObjective, Targets

STATS = (
    "rewards_chosen",
    "rewards_rejected",
    "rewards_margin",
    "rewards_accuracy",
    "logps_chosen",
    "logps_rejected",
)


@dataclass
class PairTargets(Targets):
    """One micro-batch of pairs: besides the positions and their tokens (n,), per position its row
    and whether it is a completion label (else a chosen prompt position: ORPO's NLL); per row its
    completion counts and reference log-prob; per pair whether it is real."""

    seq: torch.Tensor  # (n,) int64
    comp: torch.Tensor  # (n,) bool
    n_pred: torch.Tensor  # (b,) fp32 completion tokens predicted (after the shift)
    n_comp: torch.Tensor  # (b,) fp32 completion tokens in the row (IPO's length)
    valid: torch.Tensor  # (b/2,) bool: both rows have a label (an eval rank's filler has none)
    ref: torch.Tensor | None  # (b,) fp32
    counts: dict[str, float]  # the global batch's pairs, chosen_tokens, chosen_seq_tokens


class PairObjective(SequenceObjective):
    name = "preference"

    def __init__(self, cfg: PreferenceConfig):
        self.cfg = cfg
        self.needs_reference = cfg.loss in REFERENCED

    def divisor(self, mbs: list[MicroBatch]) -> int:
        """The global batch's pairs (those with labels in both rows)."""
        return sum(int(_valid(mb.labels).sum()) for mb in mbs)

    def targets(self, mbs: list[MicroBatch], device: torch.device) -> list[Targets]:
        return [self._targets(mb, device) for mb in mbs]

    def _targets(self, mb: MicroBatch, device: torch.device) -> PairTargets:
        b, T = mb.input_ids.shape
        if b % 2:
            raise ValueError("a micro-batch of pairs has an even number of rows")
        lab = mb.labels[:, 1:]  # (b, T-1): position t predicts token t + 1
        comp = lab != IGNORE
        want = comp
        if self.cfg.loss == "orpo":  # the chosen rows' every predicted position
            n = mb.lengths if mb.lengths is not None else torch.full((b,), T)
            real = torch.arange(T - 1)[None, :] < (n - 1)[:, None]
            want = comp | (real & (torch.arange(b) % 2 == 0)[:, None])
        idx = want.reshape(-1).nonzero().squeeze(1)
        pay = mb.payload if isinstance(mb.payload, PairPayload) else None
        ref = None if pay is None else pay.ref
        if self.needs_reference and ref is None:
            raise ValueError(f"preference.loss {self.cfg.loss} needs reference log-probs in the batch")
        host = PairTargets(
            idx=idx,
            tgt=mb.input_ids[:, 1:].reshape(-1)[idx],
            seq=idx // max(T - 1, 1),
            comp=comp.reshape(-1)[idx],
            n_pred=comp.sum(1).float(),
            n_comp=(mb.labels != IGNORE).sum(1).float(),
            valid=_valid(mb.labels),
            ref=None if ref is None else ref.float(),
            counts={}
            if pay is None
            else {
                "pairs": float(pay.pairs),
                "chosen_tokens": float(pay.chosen_tokens),
                "chosen_seq_tokens": float(pay.chosen_seq_tokens),
            },
        )
        return _to(host, device)

    def loss(
        self, logps: list[torch.Tensor], targets: list[Targets]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ts = cast(list[PairTargets], targets)  # made by self.targets
        parts = [self._pair_terms(lp, t) for lp, t in zip(logps, ts, strict=True)]
        cols = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k not in ("nll", "nll_seq")}
        valid = cols["valid"]
        losses, rc, rr, lc, lr = self._losses(cols)
        zero = torch.zeros_like(losses)
        total = torch.where(valid, losses, zero).sum()
        counts = ts[0].counts
        if self.cfg.sft_weight:
            nll = sum(p["nll"] for p in parts)
            total = total + self.cfg.sft_weight * nll * _ratio(counts, "chosen_tokens")
        if self.cfg.loss == "orpo":
            total = total + sum(p["nll_seq"] for p in parts) * _ratio(counts, "chosen_seq_tokens")
        on = valid.float()
        stats = {
            "rewards_chosen": (rc * on).sum(),
            "rewards_rejected": (rr * on).sum(),
            "rewards_margin": ((rc - rr) * on).sum(),
            "rewards_accuracy": ((rc > rr).float() * on).sum(),
            "logps_chosen": (lc * on).sum(),
            "logps_rejected": (lr * on).sum(),
        }
        return total, {k: v.detach() for k, v in stats.items()}

    def _pair_terms(self, lp: torch.Tensor, t: PairTargets) -> dict[str, torch.Tensor]:
        """One micro-batch: per pair its completions' sums and counts; the NLL sums of its chosen rows."""
        b = t.n_pred.shape[0]
        sums = torch.zeros(b, dtype=lp.dtype, device=lp.device).index_add(
            0, t.seq, torch.where(t.comp, lp, 0.0)
        )
        chosen = (t.seq % 2 == 0) & t.valid[t.seq // 2]
        out = {"valid": t.valid, "pc": sums[0::2], "pr": sums[1::2]}
        out["nc"], out["nr"] = t.n_pred[0::2].clamp(min=1.0), t.n_pred[1::2].clamp(min=1.0)
        out["Lc"], out["Lr"] = t.n_comp[0::2].clamp(min=1.0), t.n_comp[1::2].clamp(min=1.0)
        if t.ref is not None:
            out["rc"], out["rr"] = t.ref[0::2], t.ref[1::2]
        out["nll"] = -torch.where(chosen & t.comp, lp, 0.0).sum()
        out["nll_seq"] = -torch.where(chosen, lp, 0.0).sum()
        return out

    def _losses(self, c: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Per pair (loss, chosen reward, rejected reward, chosen logp, rejected logp), as TRL."""
        cfg, beta, ls = self.cfg, self.cfg.beta, self.cfg.label_smoothing
        valid = c["valid"]
        pc, pr = (torch.where(valid, c[k], -1.0) for k in ("pc", "pr"))  # fillers: finite stand-ins
        if cfg.loss in REFERENCED:
            lc, lr = pc - c["rc"], pr - c["rr"]  # log-ratios against the reference
            if cfg.loss == "dpo":  # TRL 1.16's sigmoid: no label smoothing
                loss = -F.logsigmoid(beta * (lc - lr))
            elif cfg.loss == "cdpo":
                x = beta * (lc - lr)
                loss = -F.logsigmoid(x) * (1 - ls) - F.logsigmoid(-x) * ls
            else:
                loss = (lc / c["Lc"] - lr / c["Lr"] - 1 / (2 * beta)) ** 2
            return loss, beta * lc.detach(), beta * lr.detach(), pc.detach(), pr.detach()
        ac, ar = pc / c["nc"], pr / c["nr"]  # length-normalised (average_log_prob)
        if cfg.loss == "simpo":
            x = ac - ar - cfg.simpo_gamma / beta
            loss = -F.logsigmoid(beta * x) * (1 - ls) - F.logsigmoid(-beta * x) * ls
        else:  # orpo
            log_odds = (ac - ar) - (log1mexp(ac) - log1mexp(ar))
            loss = -beta * F.logsigmoid(log_odds)
        return loss, beta * ac.detach(), beta * ar.detach(), ac.detach(), ar.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, split at -ln 2 to avoid cancellation (ORPO's log-odds)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _valid(labels: torch.Tensor) -> torch.Tensor:
    """(b,) labels -> (b/2,) bool: both rows of the pair have a label after the shift."""
    has = (labels[:, 1:] != IGNORE).any(1)
    return has[0::2] & has[1::2]


def _ratio(counts: dict[str, float], key: str) -> float:
    """The global batch's pairs / its `key` tokens: turns a token sum into a pair-mean's share."""
    n = counts.get(key, 0.0)
    return counts.get("pairs", 0.0) / n if n else 0.0


def _to(t: PairTargets, device: torch.device) -> PairTargets:
    return PairTargets(
        idx=t.idx.to(device),
        tgt=t.tgt.to(device),
        seq=t.seq.to(device),
        comp=t.comp.to(device),
        n_pred=t.n_pred.to(device),
        n_comp=t.n_comp.to(device),
        valid=t.valid.to(device),
        ref=None if t.ref is None else t.ref.to(device),
        counts=t.counts,
    )
