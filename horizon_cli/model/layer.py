"""The functional decoder layer: weights arrive as arguments, because they are streamed in.

One implementation serves every family; `ArchSpec` flags switch the differences (qkv/o/mlp
biases, Qwen3's q/k norm, per-layer sliding windows). The arithmetic follows transformers'
Llama code op for op (fp32 RMSNorm statistics, cos/sin cast to the compute dtype) so fp32 runs
match it to rounding and bf16 runs to bf16 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..arch import ArchSpec
from .attend import Mask, attend
from .tiling import tiled_native

Weights = dict[str, torch.Tensor]
# LoRA (lora.linear.LayerLora): (weight name, linear input, linear output) -> adapted output
Lora = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] | None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """(..., D) -> (..., D); statistics in fp32, as transformers does."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dtype)


def inv_freq(spec: ArchSpec) -> torch.Tensor:
    """RoPE inverse frequencies (head_dim/2,) fp32: default, linear, or Llama-3.1 ("llama3") scaling."""
    rp, dim = spec.rope, spec.head_dim
    base = float(rp["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    kind = rp.get("rope_type", "default")
    if kind == "linear":
        return inv / float(rp["factor"])
    if kind == "llama3":
        factor, lo, hi = float(rp["factor"]), float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
        old = float(rp["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    return inv


def rope_tables(
    inv: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (b, T) int64 -> cos, sin (b, T, head_dim) in the compute dtype."""
    freqs = positions[..., None].to(torch.float32) * inv.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, heads, T, hd); cos/sin (b, T, hd)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


@dataclass
class AttnContext:
    """Per micro-batch tensors every layer shares: RoPE tables and attention masks.

    masks maps a window (None = full attention) to its mask (model/attend.py: a bool (b, 1, T, T)
    tensor, True = attend, or a flex block mask), or to None when plain causal attention is exact.
    cache: generation's KV cache (a transformers Cache: each layer appends its K/V and attends to
    all of them; masks are then (b, 1, T, S) over the S cached positions), or None.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    masks: dict[int | None, Mask]
    cache: Any = None


def _linear(x: torch.Tensor, w: Weights, wname: str, bname: str, lora: Lora = None) -> torch.Tensor:
    y = F.linear(x, w[wname], w.get(bname))
    return y if lora is None else lora(wname, x, y)


def attention(
    w: Weights,
    x: torch.Tensor,
    ctx: AttnContext,
    spec: ArchSpec,
    window: int | None,
    lora: Lora = None,
    layer: int = 0,
    dropout: float = 0.0,
) -> torch.Tensor:
    """x (b, T, H) normed -> (b, T, H). layer: this layer's index in ctx.cache; dropout: on the
    attention probabilities (training only, as transformers' `attention_dropout`)."""
    b, T, _ = x.shape
    hd = spec.head_dim
    q = _linear(x, w, "wq", "bq", lora).view(b, T, spec.n_heads, hd)
    k = _linear(x, w, "wk", "bk", lora).view(b, T, spec.n_kv_heads, hd)
    v = _linear(x, w, "wv", "bv", lora).view(b, T, spec.n_kv_heads, hd)
    if spec.qk_norm:  # Qwen3: RMSNorm over head_dim, before RoPE
        q, k = rms_norm(q, w["q_norm"], spec.rms_eps), rms_norm(k, w["k_norm"], spec.rms_eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, heads, T, hd)
    q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
    if ctx.cache is not None:  # generation: the cached positions' K/V, then these T (b, kv, S, hd)
        k, v = ctx.cache.update(k, v, layer)
    out = attend(q, k, v, ctx.masks.get(window), hd**-0.5, dropout)  # grouped-query K/V shared, not copied
    out = out.transpose(1, 2).reshape(b, T, spec.q_dim)
    return _linear(out, w, "wo", "bo", lora)


def mlp(w: Weights, x: torch.Tensor, lora: Lora = None) -> torch.Tensor:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    gate, up = _linear(x, w, "w_gate", "b_gate", lora), _linear(x, w, "w_up", "b_up", lora)
    return _linear(F.silu(gate) * up, w, "w_down", "b_down", lora)


def layer_forward(
    w: Weights,
    x: torch.Tensor,
    ctx: AttnContext,
    spec: ArchSpec,
    window: int | None,
    lora: Lora = None,
    layer: int = 0,
    tile: int = 0,
    deferred: bool = False,
    dropout: float = 0.0,
) -> torch.Tensor:
    """One pre-norm decoder layer: x (b, T, H) -> (b, T, H). lora: adapters on its linear layers;
    layer: its index (in a generation's KV cache); tile: tokens per tile of its token-local block
    (the MLP's norm, SwiGLU and residual; model.tiling), 0: untiled; deferred: the backward's
    recompute, whose output values are not read (the tiled block then runs in the backward);
    dropout: the attention's (training only)."""
    h = x + attention(w, rms_norm(x, w["attn_norm"], spec.rms_eps), ctx, spec, window, lora, layer, dropout)

    def block(h: torch.Tensor) -> torch.Tensor:
        return h + mlp(w, rms_norm(h, w["mlp_norm"], spec.rms_eps), lora)

    if not tile:
        return block(h)
    leaves = None
    if deferred:  # what the block computes with: its weights, and its linear layers' adapters
        leaves = [w[k] for k in BLOCK if k in w]
        leaves += [t for k in BLOCK if lora is not None and k in getattr(lora, "ab", {}) for t in lora.ab[k]]  # type: ignore[attr-defined]
    return tiled_native(block, h, tile, lora, leaves)


BLOCK = ("mlp_norm", "w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")  # the tiled block's tensors
