"""The objective seam: what the loss head computes from the last hidden states of a step.

The head sees every micro-batch of the step at once (the step is layer-major), so an objective
may look at all of them before it seeds the backward. Every objective here is a function of
per-token log-probs of the labelled positions:

    TokenCE             SFT: cross-entropy summed over the label tokens, the step loss its mean
                        over the global batch's label tokens. One pass: each logits chunk's
                        backward right after its forward (model.head.head_forward_backward).
    SequenceObjective   any function of per-token log-probs that is not token-local (a sequence's
                        sum, a pair of sequences: DPO and its kin): a first, forward-only pass
                        gives the log-probs (n,) (model.head.token_logps), autograd on that small
                        vector gives d loss / d log p_t, and a second pass runs the chunked
                        backward seeded with those coefficients (model.head.head_backward).
                        Logits memory stays bounded by a chunk; the head's weights still load once.

The engine divides: an objective returns a *sum* (over tokens, or pairs) and differentiates it
times `inv` = 1 / the global batch's divisor (label tokens for SFT), so the gradients of every
micro-batch, and of every rank, add up to those of the mean. `targets` runs on the host before any
compute is queued (no device sync on data-dependent shapes); `stats` are what the engine reports:
sums, except those an objective names in `reductions` (engine.stats: the least or the most).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..data.batch import MicroBatch
from ..model.head import (
    LM,
    Logits,
    Norm,
    head_backward,
    head_forward_backward,
    head_loss,
    label_index,
    token_logps,
    token_logps_entropies,
)
from .stats import Kinds


@dataclass
class Targets:
    """One micro-batch's labelled positions (flat indices into (b, T-1)) and their tokens, on the
    device; objectives that need more per position or sequence subclass it."""

    idx: torch.Tensor
    tgt: torch.Tensor


@dataclass
class Head:
    """The loss head as an objective computes with it in one step: the final norm and LM head on
    the device, and where their gradients go (None: a frozen head, LoRA: input gradients only)."""

    norm: Norm
    norm_w: dict[str, torch.Tensor]
    lm: LM  # the LM head's weight, or every tensor the logits use by name (generic path)
    logits: Logits
    chunk: int
    g_norm: dict[str, torch.Tensor] | None = None
    g_lm: LM | None = None

    @property
    def device(self) -> torch.device:
        lm = self.lm if isinstance(self.lm, torch.Tensor) else next(iter(self.lm.values()))
        return lm.device

    def ce(self, x: torch.Tensor, t: Targets, inv: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed cross-entropy, dh of it times `inv`): one pass."""
        return head_forward_backward(
            x,
            self.norm,
            self.norm_w,
            self.lm,
            t.idx,
            t.tgt,
            inv,
            self.chunk,
            self.g_norm,
            self.g_lm,
            self.logits,
        )

    def ce_sum(self, x: torch.Tensor, t: Targets) -> torch.Tensor:
        """Summed cross-entropy, forward only."""
        return head_loss(x, self.norm, self.norm_w, self.lm, t.idx, t.tgt, self.chunk, self.logits)

    def logps(self, x: torch.Tensor, t: Targets) -> torch.Tensor:
        """log p of each labelled token (n,) fp32, forward only."""
        return token_logps(x, self.norm, self.norm_w, self.lm, t.idx, t.tgt, self.chunk, self.logits)

    def logps_entropies(self, x: torch.Tensor, t: Targets) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p of each labelled token, the entropy of its distribution) (n,) fp32 each, forward only."""
        return token_logps_entropies(
            x, self.norm, self.norm_w, self.lm, t.idx, t.tgt, self.chunk, self.logits
        )

    def backward(self, x: torch.Tensor, t: Targets, coef: torch.Tensor) -> torch.Tensor:
        """dh of sum_t coef_t * log p_t (parameter gradients added where they go)."""
        return head_backward(
            x,
            self.norm,
            self.norm_w,
            self.lm,
            t.idx,
            t.tgt,
            coef,
            self.chunk,
            self.g_norm,
            self.g_lm,
            self.logits,
        )


@dataclass
class HeadOut:
    loss_sum: torch.Tensor  # fp32 scalar on the device: the step loss times the divisor
    dx: list[torch.Tensor]  # per micro-batch, (b, T, H): d (loss_sum * inv) / d h
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # sums over this rank's data


class Objective(ABC):
    name: str = ""
    reductions: Kinds = {}  # its stats that are not sums, by name (engine.stats); none here

    def targets(self, mbs: list[MicroBatch], device: torch.device) -> list[Targets]:
        """Labelled positions and their targets per micro-batch, sent to the device."""
        out = []
        for mb in mbs:
            idx, tgt = label_index(mb.labels)
            out.append(Targets(idx.to(device), tgt.to(device)))
        return out

    def divisor(self, mbs: list[MicroBatch]) -> int:
        """What the step's loss sum is divided by (computed from the global batch)."""
        return sum(mb.label_tokens for mb in mbs)

    def across_ranks(self, all_sum: Callable[[torch.Tensor], None]) -> None:
        """Told once at assembly, on more than one rank: `all_sum(t)` sums t over the ranks in place
        (a collective each rank calls in the same order). An objective whose loss needs a statistic of
        the global batch (KTO's KL estimate) keeps it; the others need nothing across ranks."""
        return None

    @abstractmethod
    def train(self, head: Head, xs: list[torch.Tensor], targets: list[Targets], inv: float) -> HeadOut:
        """Loss sum and input gradients of this rank's micro-batches."""

    def evaluate(
        self, head: Head, xs: list[torch.Tensor], targets: list[Targets]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the summed loss, stats), forward only (evaluation: cross-entropy unless an objective says)."""
        total = torch.zeros((), dtype=torch.float32, device=head.device)
        for x, t in zip(xs, targets, strict=True):
            total += head.ce_sum(x, t)
        return total, {}


class TokenCE(Objective):
    """Next-token cross-entropy, averaged over every label token of the global batch."""

    name = "sft"

    def train(self, head: Head, xs: list[torch.Tensor], targets: list[Targets], inv: float) -> HeadOut:
        loss_sum = torch.zeros((), dtype=torch.float32, device=head.device)
        dx = []
        for x, t in zip(xs, targets, strict=True):
            ls, dh = head.ce(x, t, inv)
            loss_sum += ls
            dx.append(dh)
        return HeadOut(loss_sum, dx)


class SequenceObjective(Objective):
    """An objective of per-token log-probs that is not token-local: two passes over the head."""

    @abstractmethod
    def loss(
        self, logps: list[torch.Tensor], targets: list[Targets]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the loss summed over this rank's sequences or pairs, stats) from each micro-batch's
        per-token log-probs (n_m,) fp32, differentiable."""

    def first_pass(self, head: Head, x: torch.Tensor, t: Targets) -> torch.Tensor:
        """One micro-batch's per-token log-probs (n,), forward only; an objective that needs more of
        the logits (GRPO's entropies) computes it here, in the same chunks, and keeps it in `t`."""
        return head.logps(x, t)

    def train(self, head: Head, xs: list[torch.Tensor], targets: list[Targets], inv: float) -> HeadOut:
        flat = torch.cat([self.first_pass(head, x, t) for x, t in zip(xs, targets, strict=True)])
        leaf = flat.detach().requires_grad_(True)
        sizes = [t.idx.numel() for t in targets]
        with torch.enable_grad():
            loss_sum, stats = self.loss(list(torch.split(leaf, sizes)), targets)
            (coef,) = torch.autograd.grad(loss_sum * inv, leaf, allow_unused=True)
        coef = torch.zeros_like(leaf) if coef is None else coef
        dx = [head.backward(x, t, c) for x, t, c in zip(xs, targets, torch.split(coef, sizes), strict=True)]
        return HeadOut(loss_sum.detach(), dx, {k: v.detach() for k, v in stats.items()})

    def evaluate(
        self, head: Head, xs: list[torch.Tensor], targets: list[Targets]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The objective's own loss and stats, forward only (one pass over the head)."""
        logps = [self.first_pass(head, x, t) for x, t in zip(xs, targets, strict=True)]
        loss_sum, stats = self.loss(logps, targets)
        return loss_sum.detach(), {k: v.detach() for k, v in stats.items()}
