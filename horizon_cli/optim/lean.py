"""Lean AdamW state (`optim.memory: lean`): what is kept per element, and the reference update.

Pure-torch reference of kernels/adamw.cpp's `adamw_lean` (optimize stage); both are bitwise equal
(tests/optim/test_lean.py). Per element of a matrix, 3 bytes of optimizer state beside the bf16 streaming
copy and its bf16 gradient (7.125 B/param in all with the block scales):

  hi   bf16   the streaming copy = the master rounded to nearest bf16
  lo8  int8   the master's next 8 bits. The master is the fp32 whose bits are
              (hi << 16) + (lo8 << 8): an fp32 rounded to 16 significant bits. This is FlashOptim's
              master-weight split (bf16 + an 8-bit correction within the bf16's ulp; Gonzalez Ortiz
              et al. 2026, arXiv 2602.23349) done on the bit pattern, like optim.split's exact one.
  qm   uint8  the first moment in blocks of BLOCK elements, as a sign + 7-bit float code of m / sm
              (sm, fp32 per block: the block's absmax), 4 exponent bits and 3 mantissa bits over
              2^-15 .. 1. A float-like ("dynamic") code for the same reason as the dynamic tree
              quantization of 8-bit optimizers (Dettmers et al. 2021, arXiv 2110.02861): Adam
              divides element by element, so small elements need relative precision too.
  qw   uint8  the second moment, companded by the square root (as FlashOptim's v): w = sqrt(v)
              in blocks, an 8-bit float code of w / sw (sw: the block's max w), 4 exponent bits and
              4 mantissa bits; a nonzero w never rounds to 0 (it would divide the update by eps).

Rounding, all of it deterministic (round to nearest, ties away from zero): the master to 16
significant bits after each update; m / sm and w / sw to their nearest code. The block's largest
element is exact (code 1.0 times its scale). The AdamW arithmetic in between is exactly exact
mode's (optim.adamw, with a correctly rounded sqrt), so a step's only error is this rounding.

BLOCK = 64 = the store layout's tensor alignment, so no block spans two tensors.
"""

from __future__ import annotations

import math
import zlib

import torch

from .adamw import AdamWHyper

BLOCK = 64
E0 = 112  # fp32 biased exponent of the smallest binade: codes span 2^-15 .. 1
M_MANT, W_MANT = 3, 4  # mantissa bits of the m and w codes
M_TOP, W_TOP = 15 << M_MANT, 15 << W_MANT  # the codes of 1.0: 120 and 240
SIGN = 0x80
ONE = 0x3F800000  # the bits of 1.0


def code_values(mant: int) -> torch.Tensor:
    """Every magnitude code's value, (top + 1,) fp32: code 0 is 0, code c > 0 the fp32 whose
    exponent and mantissa fields are (c + (E0 << mant)) << (23 - mant)."""
    c = torch.arange(0, (15 << mant) + 1, dtype=torch.int32)
    out = ((c + (E0 << mant)) << (23 - mant)).view(torch.float32).clone()
    out[0] = 0.0
    return out


def encode(x: torch.Tensor, mant: int, keep_nonzero: bool) -> torch.Tensor:
    """Nearest code of each min(x, 1), x >= +0 (fp32) -> int32 codes. keep_nonzero: x > 0 never
    gets 0. Compares bit patterns, as the kernel does (NaN counts as more than 1)."""
    u = torch.clamp_max(x.contiguous().view(torch.int32), ONE)
    c = ((u + (1 << (22 - mant))) >> (23 - mant)) - (E0 << mant)  # rounds the mantissa, carries
    below = c < 1  # under the smallest binade: 0, or the smallest code if nearer (or forced)
    half = (((1 + (E0 << mant)) << (23 - mant)) - (1 << 23)) if not keep_nonzero else 1  # code 1's value / 2
    smallest = u >= half
    return torch.where(below, smallest.to(torch.int32), c)


def decode(c: torch.Tensor, mant: int) -> torch.Tensor:
    """int32 magnitude codes -> fp32 values (exact)."""
    v = ((c + (E0 << mant)) << (23 - mant)).view(torch.float32)
    return torch.where(c == 0, torch.zeros_like(v), v)


def _blocks(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, BLOCK)


def quantize_m(m: torch.Tensor, qm: torch.Tensor, sm: torch.Tensor) -> None:
    """m (N,) fp32 -> qm (N,) uint8 sign-magnitude codes, sm (N/BLOCK,) fp32 block absmax."""
    a = _blocks(m.abs())
    amax = a.amax(dim=1)  # (N/B,)
    inv = torch.where(amax > 0, torch.ones_like(amax) / amax, torch.zeros_like(amax))
    x = (a * inv[:, None]).contiguous()
    c = encode(x, M_MANT, keep_nonzero=False).view(-1)
    neg = (m.view(torch.int32) < 0) & (c != 0)
    qm.copy_((c | torch.where(neg, SIGN, 0)).to(torch.uint8))
    sm.copy_(amax)


def dequantize_m(qm: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    c = qm.to(torch.int32)
    mag = _blocks(decode(c & (SIGN - 1), M_MANT)) * sm[:, None]
    return torch.where(c >= SIGN, -mag.view(-1), mag.view(-1))


def quantize_w(w: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> None:
    """w = sqrt(v) >= 0, (N,) fp32 -> qw (N,) uint8 codes, sw (N/BLOCK,) fp32 block max."""
    b = _blocks(w)
    wmax = b.amax(dim=1)
    inv = torch.where(wmax > 0, torch.ones_like(wmax) / wmax, torch.zeros_like(wmax))
    x = (b * inv[:, None]).contiguous()
    qw.copy_(encode(x, W_MANT, keep_nonzero=True).view(-1).to(torch.uint8))
    sw.copy_(wmax)


def dequantize_w(qw: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    return (_blocks(decode(qw.to(torch.int32), W_MANT)) * sw[:, None]).view(-1)


def join24(hi: torch.Tensor, lo8: torch.Tensor) -> torch.Tensor:
    """(bf16 hi, int8 lo8) -> the fp32 master, exactly.  (N,), (N,) -> (N,)."""
    u = (hi.view(torch.int16).to(torch.int32) << 16) + (lo8.to(torch.int32) << 8)
    return u.view(torch.float32)


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32), on int64 tensors holding uint32 values."""
    m = 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & m
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def dither(seed: int, base: int, n: int) -> torch.Tensor:
    """(n,) int32 in [0, 256): the stochastic-rounding offsets of elements base .. base + n - 1 of a
    unit at one step (seed). A pure function of (seed, element): the same for any slicing, thread
    count or ISA, and on resume."""
    idx = torch.arange(base, base + n, dtype=torch.int64) & 0xFFFFFFFF
    key = int(hash32(torch.tensor([seed & 0xFFFFFFFF]))[0])
    return (hash32(idx ^ key) >> 24).to(torch.int32)


def split24_(
    master: torch.Tensor, hi: torch.Tensor, lo8: torch.Tensor, dith: torch.Tensor | None = None
) -> None:
    """fp32 -> (hi, lo8): its bits rounded to 16 significant bits, to nearest (ties away from zero)
    or, given `dith` (int32 in [0, 256) per element), stochastically: the magnitude rounds up with
    probability (its low 8 bits) / 256, so the master is unbiased (E[rounded] = master)."""
    u = master.contiguous().view(torch.int32)
    r = (u + (0x80 if dith is None else dith)) & ~0xFF  # a carry may reach the exponent: fine
    h = (r + 0x8000) >> 16  # hi: the rounded master rounded to bf16, as optim.split does
    lo8.copy_(((r - (h << 16)) >> 8).to(torch.int8))
    hi.view(torch.int16).copy_(h.to(torch.int16))


def rounding_seed(unit: str, step: int) -> int:
    """The master's stochastic-rounding key for one unit at one optimizer step (uint32)."""
    return (zlib.crc32(unit.encode()) ^ (step * 0x9E3779B9)) & 0xFFFFFFFF


def ieee_sqrt(v: torch.Tensor) -> torch.Tensor:
    """fp32 sqrt correctly rounded (through fp64, exact for fp32 inputs), as the kernel's."""
    return v.double().sqrt().float()


def adamw_lean_(
    hi: torch.Tensor,
    lo8: torch.Tensor,
    g: torch.Tensor,
    qm: torch.Tensor,
    qw: torch.Tensor,
    sm: torch.Tensor,
    sw: torch.Tensor,
    h: AdamWHyper,
    seed: int = 0,
    base: int = 0,
) -> None:
    """One AdamW step on lean state, in place. hi bf16, lo8 int8, g fp32 or bf16, qm and qw uint8,
    all (N,) with N a multiple of BLOCK; sm, sw fp32 (N/BLOCK,). seed: the unit and step's rounding
    key (`rounding_seed`); base: the unit offset of element 0 (the master's dither is per element)."""
    p = join24(hi, lo8)
    m = dequantize_m(qm, sm)
    w = dequantize_w(qw, sw)
    v = w * w
    g = g.float() * h.grad_scale
    p.mul_(1.0 - h.lr * h.weight_decay)
    m.lerp_(g, 1.0 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1.0 - h.beta2)
    bc1 = 1.0 - h.beta1**h.step
    bc2_sqrt = math.sqrt(1.0 - h.beta2**h.step)
    w = ieee_sqrt(v)
    denom = (w / bc2_sqrt).add_(h.eps)
    p.addcdiv_(m, denom, value=-h.lr / bc1)
    split24_(p, hi, lo8, dither(seed, base, p.numel()))
    quantize_m(m, qm, sm)
    quantize_w(w, qw, sw)
