"""The loss head: final norm, LM head and cross-entropy in chunks, with the backward done at once.

Only positions that carry a label are projected to the vocabulary, a chunk of them at a time:
logits memory is one chunk x vocab, never batch x seq x vocab. Each chunk's backward runs right
after its forward, so the head's weights cross the link once per step (forward and backward
together) and the logits are freed before the next chunk.

The final norm and the logits transform come from the layer template (model.template): RMSNorm
and a plain projection natively; the family's own norm module and soft-capping on the generic path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..data.batch import IGNORE

Norm = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]  # (h, norm weights) -> normed h
# the LM head's tensors: its (V, H) weight, or (generic path) every tensor the logits use, by name
LM = torch.Tensor | dict[str, torch.Tensor]
Logits = Callable[[torch.Tensor, LM], torch.Tensor]  # (x (n, H), lm) -> (n, V)


def linear(x: torch.Tensor, lm: LM) -> torch.Tensor:
    """The plain LM head: x @ W.T (the native path's logits)."""
    assert isinstance(lm, torch.Tensor)
    return F.linear(x, lm)


def _leaves(lm: LM, train: bool) -> LM:
    if isinstance(lm, torch.Tensor):
        return lm.detach().requires_grad_(train)
    return {k: v.detach().requires_grad_(train) for k, v in lm.items()}


def _flat(lm: LM) -> list[torch.Tensor]:
    return [lm] if isinstance(lm, torch.Tensor) else list(lm.values())


def label_index(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Host-side: labels (b, T) -> (flat indices into positions (b, T-1), their targets).

    Position t predicts labels[:, t + 1]; computed on the host so the device never syncs on
    a data-dependent shape.
    """
    tgt = labels[:, 1:].reshape(-1)
    idx = (tgt != IGNORE).nonzero().squeeze(1)
    return idx, tgt[idx]


def head_forward_backward(
    h: torch.Tensor,
    norm: Norm,
    norm_w: dict[str, torch.Tensor],
    lm_w: LM,
    idx: torch.Tensor,
    tgt: torch.Tensor,
    inv_n: float,
    chunk: int,
    g_norm: dict[str, torch.Tensor] | None,
    g_lm: LM | None,
    logits_fn: Logits = linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h (b, T, H) -> (loss_sum fp32 scalar, dh (b, T, H)).

    The loss is sum(CE) * inv_n (inv_n = 1 / label tokens of the whole global batch), so the
    gradients of all micro-batches add up to those of the token-level mean. Parameter grads
    are added in fp32 to g_norm (by name) and g_lm (V, H); with both None (a frozen head, LoRA)
    only the input gradient is computed.
    """

    def ce(logits: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        loss = F.cross_entropy(logits, tgt[a:b], reduction="sum")
        return loss * inv_n, loss

    return _chunked_backward(h, norm, norm_w, lm_w, idx, chunk, g_norm, g_lm, logits_fn, ce)


def head_backward(
    h: torch.Tensor,
    norm: Norm,
    norm_w: dict[str, torch.Tensor],
    lm_w: LM,
    idx: torch.Tensor,
    tgt: torch.Tensor,
    coef: torch.Tensor,
    chunk: int,
    g_norm: dict[str, torch.Tensor] | None,
    g_lm: LM | None,
    logits_fn: Logits = linear,
) -> torch.Tensor:
    """The backward of sum_t coef_t * log p(tgt_t) over the labelled positions: dh (b, T, H), and
    the parameter grads added as in head_forward_backward. coef (n,) fp32: d objective / d log p_t,
    from an objective's first pass over `token_logps` (engine.objective)."""

    def weighted(logits: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        ce = F.cross_entropy(logits, tgt[a:b], reduction="none")  # -log p, (c,)
        loss = -(ce * coef[a:b]).sum()
        return loss, loss

    return _chunked_backward(h, norm, norm_w, lm_w, idx, chunk, g_norm, g_lm, logits_fn, weighted)[1]


ChunkLoss = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]


def _chunked_backward(
    h: torch.Tensor,
    norm: Norm,
    norm_w: dict[str, torch.Tensor],
    lm_w: LM,
    idx: torch.Tensor,
    chunk: int,
    g_norm: dict[str, torch.Tensor] | None,
    g_lm: LM | None,
    logits_fn: Logits,
    chunk_loss: ChunkLoss,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final norm, then chunk by chunk over the labelled rows: logits, `chunk_loss(fp32 logits, a,
    b)` -> (what to differentiate, what to sum), its backward at once. -> (sum, dh)."""
    train = g_lm is not None
    h = h.detach().requires_grad_(True)
    wn = {k: v.detach().requires_grad_(train) for k, v in norm_w.items()}
    W = _leaves(lm_w, train)
    hn = norm(h, wn)  # (b, T, H) (h: several residual streams, which the final modules merge)
    sel = hn[:, :-1].reshape(-1, hn.shape[-1]).index_select(0, idx)  # (n, H) rows that carry a label
    dsel = torch.empty_like(sel)
    loss_sum = torch.zeros((), dtype=torch.float32, device=h.device)
    for a in range(0, sel.shape[0], chunk):
        x = sel[a : a + chunk].detach().requires_grad_(True)
        logits = logits_fn(x, W)  # (c, V) in the compute dtype, as transformers does
        diff, value = chunk_loss(logits.float(), a, a + x.shape[0])
        grads = torch.autograd.grad(diff, (x, *_flat(W)) if train else (x,), allow_unused=True)
        dsel[a : a + chunk] = grads[0]
        if g_lm is not None:
            dest = [g_lm] if isinstance(g_lm, torch.Tensor) else [g_lm[k] for k in W]
            for g_t, gw in zip(dest, grads[1:], strict=True):
                if gw is not None:
                    g_t.add_(gw)
        loss_sum += value.detach()
        del logits, diff, value, grads
    if sel.shape[0]:
        torch.autograd.backward(sel, dsel)
    dh = h.grad if h.grad is not None else torch.zeros_like(h)
    for k, leaf in wn.items():
        if leaf.grad is not None and g_norm is not None:
            g_norm[k].add_(leaf.grad)
    return loss_sum, dh


def _forward_chunks(h, norm: Norm, norm_w, lm_w, idx, chunk: int, logits_fn: Logits):
    """Forward only: (a, b, fp32 logits of labelled rows [a, b)), one chunk at a time."""
    hn = norm(h, norm_w)
    sel = hn[:, :-1].reshape(-1, hn.shape[-1]).index_select(0, idx)
    for a in range(0, sel.shape[0], chunk):
        x = sel[a : a + chunk]
        yield a, a + x.shape[0], logits_fn(x, lm_w).float()


@torch.no_grad()
def token_logps(
    h: torch.Tensor,
    norm: Norm,
    norm_w: dict[str, torch.Tensor],
    lm_w: LM,
    idx: torch.Tensor,
    tgt: torch.Tensor,
    chunk: int,
    logits_fn: Logits = linear,
) -> torch.Tensor:
    """Forward only: log p(tgt_t) (n,) fp32 at every labelled position, logits bounded by a chunk."""
    out = torch.empty(idx.numel(), dtype=torch.float32, device=h.device)
    for a, b, logits in _forward_chunks(h, norm, norm_w, lm_w, idx, chunk, logits_fn):
        out[a:b] = -F.cross_entropy(logits, tgt[a:b], reduction="none")
    return out


@torch.no_grad()
def token_logps_entropies(
    h: torch.Tensor,
    norm: Norm,
    norm_w: dict[str, torch.Tensor],
    lm_w: LM,
    idx: torch.Tensor,
    tgt: torch.Tensor,
    chunk: int,
    logits_fn: Logits = linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only: log p(tgt_t) (n,) fp32 and the entropy of the whole distribution there (n,)
    fp32, -sum p log p in nats (as TRL's entropy_from_logits), logits bounded by a chunk."""
    logp = torch.empty(idx.numel(), dtype=torch.float32, device=h.device)
    ent = torch.empty(idx.numel(), dtype=torch.float32, device=h.device)
    for a, b, logits in _forward_chunks(h, norm, norm_w, lm_w, idx, chunk, logits_fn):
        lsm = F.log_softmax(logits, dim=-1)
        logp[a:b] = lsm.gather(1, tgt[a:b].unsqueeze(1)).squeeze(1)
        p = torch.exp(lsm)  # (c, V) fp32: two chunk-sized copies besides the logits, as the plan's head work
        ent[a:b] = -p.mul_(lsm).sum(-1)
        del lsm, p
    return logp, ent


@torch.no_grad()
def token_scores(
    h: torch.Tensor,
    norm: Norm,
    norm_w: dict[str, torch.Tensor],
    lm_w: LM,
    idx: torch.Tensor,
    tgt: torch.Tensor,
    chunk: int,
    logits_fn: Logits = linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only (the evaluation harness): log p(tgt_t) (n,) fp32 and whether tgt_t is the most
    likely token (n,) bool, at every labelled position, logits bounded by a chunk."""
    logp = torch.empty(idx.numel(), dtype=torch.float32, device=h.device)
    best = torch.empty(idx.numel(), dtype=torch.bool, device=h.device)
    for a, b, logits in _forward_chunks(h, norm, norm_w, lm_w, idx, chunk, logits_fn):
        logp[a:b] = -F.cross_entropy(logits, tgt[a:b], reduction="none")
        best[a:b] = logits.argmax(dim=-1) == tgt[a:b]
    return logp, best


@torch.no_grad()
def head_loss(
    h: torch.Tensor,
    norm: Norm,
    norm_w: dict[str, torch.Tensor],
    lm_w: LM,
    idx: torch.Tensor,
    tgt: torch.Tensor,
    chunk: int,
    logits_fn: Logits = linear,
) -> torch.Tensor:
    """Forward only (evaluation): summed cross-entropy over labelled positions, chunked."""
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for a, b, logits in _forward_chunks(h, norm, norm_w, lm_w, idx, chunk, logits_fn):
        total += F.cross_entropy(logits, tgt[a:b], reduction="sum")
    return total
