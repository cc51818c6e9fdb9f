"""Weight-only quantization of a resident rollout copy (generate.resident): a layer's tensors held
in a narrow format on the device and dequantized into the compute dtype when the layer runs.

    full   the tensor as streamed (the compute dtype): no rounding at all
    int8   per output channel (each row of the tensor viewed as (-1, last dim)): scale = absmax / 127,
           codes round(x / scale) in [-127, 127]; x ~ code x scale
    fp8    per output channel: scale = absmax / 448, codes (x / scale) as torch.float8_e4m3fn
           (round to nearest even), x ~ code x scale (vLLM's per-channel FP8 weights)
    nf4    bitsandbytes' NF4 with double quantization, blocks of 64 (quant.nf4_bnb)

Only matrices are narrowed (2 or more dims; nf4: whole blocks too): norms, biases and other
vectors stay in the compute dtype, as vLLM and bitsandbytes keep them. Dequantization computes
code x scale in fp32 and rounds once into the output's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import nf4, nf4_bnb

FORMATS = ("full", "fp8", "int8", "nf4")
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
INT8_MAX = 127.0


@dataclass
class QTensor:
    """One tensor of a resident copy: its format, codes (or the tensor itself: full), per-row
    scales (rows, 1) fp32 (int8, fp8) or NF4 parts, the shape it dequantizes to."""

    kind: str
    data: torch.Tensor | None
    scale: torch.Tensor | None = None
    parts: dict[str, torch.Tensor] | None = None

    def nbytes(self) -> int:
        ts = [self.data, self.scale, *(self.parts or {}).values()]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def dequantize(self, out: torch.Tensor) -> torch.Tensor:
        """Into `out` (the tensor's shape, the compute dtype, the copy's device)."""
        if self.kind == "nf4":
            assert self.parts is not None
            nf4_bnb.dequantize(self.parts, out.view(-1))
            return out
        assert self.data is not None
        if self.kind == "full":
            return out.copy_(self.data)
        assert self.scale is not None
        torch.mul(self.data.float(), self.scale, out=out.view(self.data.shape))
        return out


def narrowed(shape: tuple[int, ...], fmt: str) -> bool:
    """Whether a tensor of this shape is held narrow in `fmt` (else as streamed)."""
    if fmt == "full" or len(shape) < 2:
        return False
    return nf4.quantizable(shape) if fmt == "nf4" else True


def quantize(x: torch.Tensor, fmt: str) -> QTensor:
    """x (any shape, a float dtype, on the copy's device) -> its QTensor in `fmt`, on x's device."""
    if not x.is_floating_point() or not narrowed(tuple(x.shape), fmt):
        return QTensor("full", x.clone())
    if fmt == "nf4":
        return QTensor("nf4", None, parts=nf4.quantize(x.reshape(-1)))
    rows = x.reshape(-1, x.shape[-1]).float()  # (out channels, in)
    top = INT8_MAX if fmt == "int8" else FP8_MAX
    scale = rows.abs().amax(dim=1, keepdim=True) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: codes 0
    q = rows / scale
    if fmt == "int8":
        codes = torch.round(q).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif fmt == "fp8":
        codes = q.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        raise ValueError(f"unknown weight format {fmt!r}")
    return QTensor(fmt, codes, scale)


def bytes_per_param(fmt: str, itemsize: int) -> float:
    """A narrowed matrix's bytes per element, its scales included (the plan's figure): int8 and
    fp8 one byte (a row's fp32 scale is negligible), nf4 half a byte plus a block's byte of
    absmax per 64, full the compute dtype's."""
    return {"full": float(itemsize), "int8": 1.0, "fp8": 1.0, "nf4": 0.5 + 1 / nf4.BLOCK}[fmt]


def packed_nbytes(shape: tuple[int, ...], fmt: str, itemsize: int) -> int:
    """Bytes one tensor of `shape` holds in `fmt` (what `quantize` makes of it)."""
    numel = math.prod(shape)
    if not narrowed(shape, fmt):
        return numel * itemsize
    if fmt == "nf4":
        nb = numel // nf4.BLOCK
        return numel // 2 + nb + 4 * -(-nb // nf4_bnb.GROUP) + 4 + 4 * 256  # codes, absmaxes, map
    return numel + 4 * (numel // shape[-1])  # codes and a row's fp32 scale
