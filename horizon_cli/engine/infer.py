"""Forward-only passes on the streamed engine: each layer loaded once for the whole pass.

    hidden          the last hidden states of every micro-batch, and the head on the device
    evaluate        the objective's summed loss, its divisor and its stats (SFT: cross-entropy
                    over the label tokens)
    sequence_logps  each row's summed log-prob of its labelled tokens (the reference pass of
                    preference objectives; LoRA: with the adapters off, the base alone)
    scores          per labelled token its log-prob and whether it is the argmax (the evaluation
                    harness)
    logits          full (b, T, V) logits of a small micro-batch (tests, spot checks)

The same sweep as a training step's forward (engine.sweep), without saving inputs and with
dropout off; the reference pass of preference objectives and generation build on it.
"""

from __future__ import annotations

import torch

from ..data.batch import MicroBatch
from ..model.head import label_index, token_scores
from .objective import Head, Targets
from .parts import Parts
from .passes import ForwardPass
from .sweep import Sweep


class Inference:
    def __init__(self, p: Parts, sweep: Sweep):
        self.p, self.sweep = p, sweep

    @torch.no_grad()
    def hidden(self, mbs: list[MicroBatch]) -> tuple[list[torch.Tensor], Head]:
        """(last hidden states per micro-batch, the head on the device): the caller must
        `sweep.release_head()` once done with the head."""
        ctxs = self.sweep.contexts(mbs)
        passes = [ForwardPass(self.p)] * len(self.p.tmpl.calls)
        x = self.sweep.start(mbs, self.sweep.loads(passes))
        x = self.sweep.layers(x, ctxs, passes)
        return x, self.sweep.acquire_head()

    @torch.no_grad()
    def evaluate(self, mbs: list[MicroBatch]) -> tuple[float, int, dict[str, float]]:
        """(summed loss, divisor, stat sums) of a forward pass, over every rank; logits bounded by a chunk."""
        p = self.p
        targets = p.objective.targets(mbs, p.t.device)
        x, head = self.hidden(mbs)
        total, stats = p.objective.evaluate(head, x, targets)
        self.sweep.release_head()
        return p.reduce.eval_total(total, p.objective.divisor(mbs), stats)

    @torch.no_grad()
    def sequence_logps(self, mbs: list[MicroBatch], adapters: bool = True) -> list[torch.Tensor]:
        """Per micro-batch (b,) fp32 on the host: sum of log p over each row's labelled tokens."""
        p = self.p
        targets = []
        for mb in mbs:
            idx, tgt = label_index(mb.labels)
            targets.append(Targets(idx.to(p.t.device), tgt.to(p.t.device)))
        with p.params.adapters(adapters):
            x, head = self.hidden(mbs)
        out = []
        for xm, t, mb in zip(x, targets, mbs, strict=True):
            b, T = mb.input_ids.shape
            lp = head.logps(xm, t)
            sums = torch.zeros(b, dtype=torch.float32, device=lp.device).index_add_(
                0, t.idx // max(T - 1, 1), lp
            )
            out.append(sums.cpu())
        self.sweep.release_head()
        return out

    @torch.no_grad()
    def scores(self, mbs: list[MicroBatch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per micro-batch, at its labelled positions in row-major order: log p of the label (n,)
        fp32 and whether it is the most likely token (n,) bool, on the host. One sweep."""
        p = self.p
        where = [label_index(mb.labels) for mb in mbs]  # on the host, before any compute
        x, head = self.hidden(mbs)
        out = []
        for xm, (idx, tgt) in zip(x, where, strict=True):
            dev = p.t.device
            logp, best = token_scores(
                xm, head.norm, head.norm_w, head.lm, idx.to(dev), tgt.to(dev), head.chunk, head.logits
            )
            out.append((logp.cpu(), best.cpu()))
        self.sweep.release_head()
        return out

    @torch.no_grad()
    def logits(self, mb: MicroBatch) -> torch.Tensor:
        """Full (b, T, V) fp32 logits of one small micro-batch — for tests and spot checks only."""
        (x,), head = self.hidden([mb])
        out = head.logits(head.norm(x, head.norm_w), head.lm).float().cpu()
        self.sweep.release_head()
        return out
