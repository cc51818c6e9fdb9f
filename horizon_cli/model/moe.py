"""Router statistics of one optimizer step: expert load and the load-balancing auxiliary loss.

transformers' Switch-style auxiliary loss (`load_balancing_loss_func`, the same in Mixtral,
Qwen2-MoE, Qwen3-MoE and gpt-oss) couples every MoE layer: with r_l the router logits of layer l
(rows = tokens), p = softmax(r_l), m the real-token mask, E experts, L routed layers, N real
tokens and k = top-k,

    C_e = sum_l sum_t m_t [e in topk(p_lt)]        (assignments, not differentiable)
    P_e = sum_l sum_t m_t p_lte                    (probability mass)
    aux = E * sum_e (C_e / (L N)) * (P_e / (L N))

so d aux / d r_l = E / (L N)^2 * m_t * J_softmax(r_lt)^T C: layer l's share of the gradient needs
C, which is known only after *every* layer's forward. The streamed schedule has exactly that: the
forward pass (all layers) records each layer's counts; the backward pass, recomputing layer l,
adds the scalar  coef * E / (L N)^2 * sum_t m_t p_lt . C  to that layer's objective, whose
gradient is the exact share above (C is a constant of the step).

A global batch split into micro-batches is treated as one batch: C, P and N run over the real
tokens of every micro-batch, so the value is transformers' aux_loss for the whole global batch
(padding masked out) and does not depend on the split, like the cross-entropy.

Sharded runs (several ranks, each its share of the micro-batches): `reduce` sums C, P, N and the
expert loads over the ranks at the end of the forward, so the aux loss, its gradient and the
imbalance are those of the global batch, as on one rank.

Expert load imbalance per routed layer is max / mean of the tokens each expert received, counted
from the router's own top-k indices (DeepSeek-V3's group-limited choice included).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..arch.generic_arch import Moe


class RouterStats:
    def __init__(self, moe: Moe):
        self.n = int(moe.n_experts)
        self.k = int(moe.top_k)
        self.layers = list(moe.layers)
        self.logits_index = moe.logits_index  # which of the router's outputs are its logits
        self.coef = moe.aux_coef  # None: the aux loss is reported, not trained
        self.reduce: Callable[[torch.Tensor], None] | None = None  # sum over ranks, in place
        self.begin_step()

    def begin_step(self) -> None:
        self.C: torch.Tensor | None = None  # (E,) fp32, all layers
        self.P: torch.Tensor | None = None
        self.N: torch.Tensor | None = (
            None  # real tokens of the global batch (counted at the first routed layer)
        )
        self.load: dict[int, torch.Tensor] = {}  # layer -> (E,) tokens routed to each expert
        self.scale: torch.Tensor | None = None
        self.aux: torch.Tensor | None = None

    def record(
        self, layer: int, logits: torch.Tensor, chosen: torch.Tensor | None, mask: torch.Tensor
    ) -> None:
        """Forward of `layer` on one micro-batch: logits (rows, E), the router's chosen experts
        (rows, k) or None, mask (rows,) fp32 1 for real tokens."""
        with torch.no_grad():
            # the router may score more than the routed experts (LongCat's zero-computation ones)
            self.n = max(self.n, logits.shape[-1])
            probs = torch.softmax(logits, dim=-1)
            _, top = torch.topk(probs, self.k, dim=-1)
            ones = mask.repeat_interleave(self.k)
            counts = torch.zeros(self.n, dtype=torch.float32, device=logits.device).scatter_add_(
                0, top.reshape(-1), ones
            )
            mass = (probs.float() * mask[:, None]).sum(0)
            self.C = counts if self.C is None else self.C + counts
            self.P = mass if self.P is None else self.P + mass
            if layer == self.layers[0]:
                self.N = mask.sum() if self.N is None else self.N + mask.sum()
            if chosen is not None:
                used = torch.zeros(self.n, dtype=torch.float32, device=logits.device)
                used.scatter_add_(0, chosen.reshape(-1).long(), mask.repeat_interleave(chosen.shape[-1]))
                self.load[layer] = used if layer not in self.load else self.load[layer] + used

    def end_forward(self) -> None:
        """Every layer's forward is done: the step's aux loss and each layer's gradient scale."""
        if self.C is None or self.P is None or self.N is None:
            return
        if self.reduce is not None:
            self._sum_over_ranks(self.reduce)
        rows = self.N * len(self.layers)
        self.aux = self.n * torch.sum((self.C / rows) * (self.P / rows))
        if self.coef:
            self.scale = self.coef * self.n / (rows * rows)

    def _sum_over_ranks(self, reduce: Callable[[torch.Tensor], None]) -> None:
        """This rank's C, P, N and loads -> the global batch's (one collective)."""
        assert self.C is not None and self.P is not None and self.N is not None
        layers = sorted(self.load)
        parts = [self.C, self.P, self.N.reshape(1).float(), *(self.load[i] for i in layers)]
        flat = torch.cat(parts)
        reduce(flat)
        sizes = [p.numel() for p in parts]
        c, p, n, *loads = torch.split(flat, sizes)
        self.C, self.P, self.N = c, p, n[0]
        self.load = dict(zip(layers, loads, strict=True))

    def objective(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """Backward recompute of a routed layer on one micro-batch: the scalar whose gradient is
        this layer's share of coef * d aux (None when the aux loss is off)."""
        if self.scale is None or self.C is None:
            return None
        probs = torch.softmax(logits, dim=-1).float()  # (rows, E), as transformers computes it
        return self.scale * torch.sum((probs * mask[:, None]) @ self.C)

    def result(self) -> tuple[float | None, list[float]]:
        """(aux loss, max/mean tokens per expert of each routed layer) — one host sync."""
        if self.aux is None:
            return None, []
        vals = [self.aux] + [
            self.load[i].max() / self.load[i].mean().clamp_min(1e-12) for i in sorted(self.load)
        ]
        out = torch.stack([v.float() for v in vals]).tolist()
        return out[0], out[1:]


def experts_fallback(model) -> None:
    """transformers' grouped_mm experts need 16-byte strides: an expert matrix whose width is not a
    multiple of 8 elements fails in bf16 ("strides should be multiple of 16 bytes"; transformers'
    own model too). Such models (no released one) run its batched_mm experts: the same arithmetic
    without the grouped GEMM. The layers read config._experts_implementation at call time."""
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        if getattr(cfg, "_experts_implementation", None) != "grouped_mm":
            continue
        for name, p in model.named_parameters():
            if ".experts." in name and p.dim() == 3 and any(d % 8 for d in p.shape[1:]):
                cfg._experts_implementation = "batched_mm"
                break
