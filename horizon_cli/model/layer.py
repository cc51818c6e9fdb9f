"""The functional decoder layer: weights arrive as arguments, because they are streamed in.

One implementation serves every family; `ArchSpec` flags switch the differences (qkv/o/mlp
biases, Qwen3's q/k norm, per-layer sliding windows). The arithmetic follows transformers'
Llama code op for op (fp32 RMSNorm statistics, cos/sin cast to the compute dtype) so fp32 runs
match it to rounding and bf16 runs to bf16 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..arch import ArchSpec
from . import fused
from .attend import BlockMask, Mask, RowMask, attend, causal_rows, rows_mask
from .call import LayerCall
from .call import Lora as Adapters
from .tiled_layer import Stages, run_layer
from .tiling import tiled_native

Weights = dict[str, torch.Tensor]
# LoRA (lora.linear.LayerLora, keyed for the call): (weight name, linear input, linear output) -> adapted output
Lora = Adapters | None
UNTILED = LayerCall()  # a call of its own: untiled, no adapters, no dropout (a layer run alone)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """(..., D) -> (..., D); statistics in fp32, as transformers does."""
    if fused.enabled(x):  # HORIZON_FUSED=1 on CUDA (model.fused; off by default)
        return fused.compiled(eager_rms_norm)(x, w, eps)
    return eager_rms_norm(x, w, eps)


def eager_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
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
    if fused.enabled(x):
        return fused.compiled(eager_rope)(x, cos, sin)
    return eager_rope(x, cos, sin)


def eager_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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


def _heads(
    w: Weights, x: torch.Tensor, spec: ArchSpec, which: str, cos, sin, lora: Lora = None
) -> torch.Tensor:
    """x (b, T, H) normed -> q, k or v (b, heads, T, hd): projection, bias, Qwen3's RMSNorm over
    head_dim (q, k), RoPE at cos/sin's positions (q, k)."""
    b, T, _ = x.shape
    heads = spec.n_heads if which == "q" else spec.n_kv_heads
    y = _linear(x, w, f"w{which}", f"b{which}", lora).view(b, T, heads, spec.head_dim)
    if which == "v":
        return y.transpose(1, 2)
    if spec.qk_norm:  # Qwen3: RMSNorm over head_dim, before RoPE
        y = rms_norm(y, w[f"{which}_norm"], spec.rms_eps)
    return apply_rope(y.transpose(1, 2), cos, sin)


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
    q, k, v = (_heads(w, x, spec, n, ctx.cos, ctx.sin, lora) for n in "qkv")  # (b, heads, T, hd)
    if ctx.cache is not None:  # generation: the cached positions' K/V, then these T (b, kv, S, hd)
        k, v = ctx.cache.update(k, v, layer)
    scale = spec.head_dim**-0.5
    out = attend(q, k, v, ctx.masks.get(window), scale, dropout)  # grouped-query K/V shared, not copied
    out = out.transpose(1, 2).reshape(b, T, spec.q_dim)
    return _linear(out, w, "wo", "bo", lora)


def mlp(w: Weights, x: torch.Tensor, lora: Lora = None) -> torch.Tensor:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    gate, up = _linear(x, w, "w_gate", "b_gate", lora), _linear(x, w, "w_up", "b_up", lora)
    return _linear(swiglu(gate, up), w, "w_down", "b_down", lora)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if fused.enabled(gate):
        return fused.compiled(eager_swiglu)(gate, up)
    return eager_swiglu(gate, up)


def eager_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def layer_forward(
    w: Weights,
    x: torch.Tensor,
    ctx: AttnContext,
    spec: ArchSpec,
    window: int | None,
    call: LayerCall = UNTILED,
) -> torch.Tensor:
    """One pre-norm decoder layer: x (b, T, H) -> (b, T, H), for `call` (model.call): its adapters,
    its layer's index (in a generation's KV cache), its tile (tokens per tile: every token-local
    part tiled, the attention per query tile, model.tiled_layer; 0: untiled), whether it is the
    backward's recompute, whose output values are not read (`deferred`: the tiled layer then runs
    in the backward), and whether the attention drops (training with the model's dropout). With a
    KV cache, attention dropout or a flex block mask (CUDA: packed rows, windows) only the MLP
    block is tiled (model.tiling)."""
    dropout = spec.attn_dropout if call.dropout else 0.0
    whole = ctx.cache is not None or dropout or isinstance(ctx.masks.get(window), BlockMask)
    if 0 < call.tile < x.numel() // x.shape[-1] and not whole:
        return run_layer(_stages(w, ctx, spec, window), x, call, _leaves(w, call.lora, None))
    lora = call.adapters
    h = x + attention(
        w, rms_norm(x, w["attn_norm"], spec.rms_eps), ctx, spec, window, lora, call.layer, dropout
    )

    def block(h: torch.Tensor, lora: Lora) -> torch.Tensor:
        return h + mlp(w, rms_norm(h, w["mlp_norm"], spec.rms_eps), lora)

    # untiled (tile 0, or no more tokens than a tile): the block once, as it is
    return tiled_native(block, h, call, _leaves(w, call.lora, BLOCK) if call.deferred else None)


def _leaves(w: Weights, lora: Lora, names: tuple[str, ...] | None) -> list[torch.Tensor]:
    """What the (tiled) part computes with: its weights (names; None: all) and their adapters."""
    keys = list(w) if names is None else [k for k in names if k in w]
    ab = lora.ab if lora is not None else {}
    return [w[k] for k in keys] + [t for k in keys if k in ab for t in ab[k]]


def _stages(w: Weights, ctx: AttnContext, spec: ArchSpec, window: int | None) -> Stages:
    """The layer's token-local passes for model.tiled_layer: per row r and positions [s, e), with
    the tile's adapters."""
    eps, rule = spec.rms_eps, ctx.masks.get(window)
    doc, win = (rule.doc, rule.window) if isinstance(rule, RowMask) else (None, window)

    def kv(r: int, s: int, e: int, xt: torch.Tensor, lora: Lora) -> tuple[torch.Tensor, torch.Tensor]:
        xn, cos, sin = rms_norm(xt, w["attn_norm"], eps), ctx.cos[r : r + 1, s:e], ctx.sin[r : r + 1, s:e]
        return _heads(w, xn, spec, "k", cos, sin, lora), _heads(w, xn, spec, "v", cos, sin, lora)

    def keys(s: int, e: int) -> int:  # the first key a query of [s, e) can see (kv > q - window)
        return 0 if win is None else max(0, s - win + 1)

    def attend_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: int, s: int) -> torch.Tensor:
        """The tile's queries over its keys [lo, e) with the tile's rows of the mask."""
        e = s + q.shape[2]
        lo = e - k.shape[2]
        if isinstance(rule, torch.Tensor):  # a dense mask built anyway (b, 1, T, T): its rows
            m: Mask = rule[r : r + 1, :, s:e, lo:e]
        else:
            m = None if rule is None and lo == s else rows_mask(doc, win, r, s, e, lo, q.device)
        if q.is_cuda and m is not None and q.shape[1] != k.shape[1]:
            # SDPA's kernels that take a mask on CUDA may not take grouped K/V (its math fallback
            # would hold the (t, keys) scores per head): repeated per query head, the plan counts it
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return attend(q, k, v, m, spec.head_dim**-0.5)

    def out(
        r: int, s: int, e: int, xt: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lora: Lora
    ) -> torch.Tensor:
        cos, sin = ctx.cos[r : r + 1, s:e], ctx.sin[r : r + 1, s:e]
        q = _heads(w, rms_norm(xt, w["attn_norm"], eps), spec, "q", cos, sin, lora)  # (1, heads, t, hd)
        if q.is_cuda or doc is not None or isinstance(rule, torch.Tensor):
            o = attend_tile(q, k, v, r, s)
        else:  # CPU rows, causal (windowed): no mask rows (attend.causal_rows)
            o = causal_rows(q, k, v, s, win, spec.head_dim**-0.5)
        o = o.transpose(1, 2).reshape(1, e - s, spec.q_dim)
        h = xt + _linear(o, w, "wo", "bo", lora)
        return h + mlp(w, rms_norm(h, w["mlp_norm"], eps), lora)

    return Stages(kv, keys, out, spec.n_kv_heads, spec.head_dim)


BLOCK = ("mlp_norm", "w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")  # the MLP block's tensors
