"""CPU AdamW over flat fp32 buffers, with the semantics of `torch.optim.AdamW`.

This is the pure-torch reference and fallback; `optim.native` runs the fused C++ kernel
(kernels/adamw.cpp) over the same buffers. One call updates one contiguous unit (a decoder
layer, the embedding, the head) in place:

  g      = grad * grad_scale                      (grad_scale: the global clip coefficient)
  p     *= 1 - lr * weight_decay                  (decoupled weight decay)
  m      = lerp(m, g, 1 - beta1)
  v      = beta2 * v + (1 - beta2) * g * g
  p     -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

The master is either an fp32 buffer (`param`), or a bf16 streaming copy plus an int16 remainder
(`hi`, `lo`, see optim.split) which this refreshes in the same call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .split import join, split_


@dataclass(frozen=True)
class AdamWHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int  # 1-based step count, for bias correction
    grad_scale: float = 1.0


def adamw_fp32_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: AdamWHyper) -> None:
    """Update fp32 `p`, `m`, `v` in place from fp32 `g`.  All (N,) contiguous."""
    if h.grad_scale != 1.0:
        g = g * h.grad_scale
    if h.weight_decay:
        p.mul_(1.0 - h.lr * h.weight_decay)
    m.lerp_(g, 1.0 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1.0 - h.beta2)
    bc1 = 1.0 - h.beta1**h.step
    bc2_sqrt = math.sqrt(1.0 - h.beta2**h.step)
    denom = (v.sqrt() / bc2_sqrt).add_(h.eps)
    p.addcdiv_(m, denom, value=-h.lr / bc1)


def adamw_split_(
    hi: torch.Tensor, lo: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: AdamWHyper
) -> None:
    """Update the master held as (bf16 `hi`, int16 `lo`) and the moments in place."""
    p = join(hi, lo)
    adamw_fp32_(p, g, m, v, h)
    split_(p, hi, lo)
