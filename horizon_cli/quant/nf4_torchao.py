"""NF4 as horizon wrote it before store version 5 (torchao's NF4Tensor arithmetic): read only.

Stores of versions 3 and 4 hold their NF4 tensors in this layout; they still open, check and
dequantize exactly as they were written (tests/quant/test_nf4_legacy.py: the bytes the older horizon
gave, from tests/fixtures/nf4-legacy). New stores are written as bitsandbytes does (nf4_bnb.py).

  * blocks of BLOCK = 64 elements, each element the index of the nearest of the 16 NF4 code
    values (rounded to 4 decimals, as torchao lists them) after dividing by its block's absmax;
    two per byte, the even element in the high nibble;
  * the block absmaxes minus their mean, as int8 in groups of GROUP = 256 blocks, each with the
    factor 256 / (2 * group absmax) (in the store dtype);
  * dequantization: scale = int8 / factor + mean, element = code_value * scale, all in the
    tensor's dtype.

A tensor of n elements is four parts, each on an ALIGN-byte boundary: codes (n/2 bytes, uint8),
scales (n/64 int8), factors (ceil(n/64/256) values of the dtype), mean (one value of the dtype).
"""

from __future__ import annotations

import torch

BLOCK = 64
GROUP = 256
ALIGN = 64

CODES = (
    -1.0,
    -0.6962,
    -0.5251,
    -0.3949,
    -0.2844,
    -0.1848,
    -0.0911,
    0.0,
    0.0796,
    0.1609,
    0.2461,
    0.3379,
    0.4407,
    0.5626,
    0.7230,
    1.0,
)


def _up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def parts(numel: int, itemsize: int) -> dict[str, tuple[int, int]]:
    """Byte (offset, length) of each part of a quantized tensor of `numel` elements."""
    blocks = numel // BLOCK
    groups = -(-blocks // GROUP)
    out, off = {}, 0
    for name, n in (
        ("codes", numel // 2),
        ("scales", blocks),
        ("factors", groups * itemsize),
        ("mean", itemsize),
    ):
        out[name] = (off, n)
        off = _up(off + n)
    return out


def nbytes(numel: int, itemsize: int) -> int:
    p = parts(numel, itemsize)["mean"]
    return _up(p[0] + p[1])


def unpack(buf: torch.Tensor, numel: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Views of the parts inside a quantized tensor's bytes (uint8)."""
    p = parts(numel, dtype.itemsize)
    view = {"codes": torch.uint8, "scales": torch.int8, "factors": dtype, "mean": dtype}
    return {k: buf[o : o + n].view(view[k]) for k, (o, n) in p.items()}


_PAIRS: dict[tuple[torch.dtype, str], torch.Tensor] = {}


def _pair_table(dtype: torch.dtype, device) -> torch.Tensor:
    """(256, 2): the two code values a packed byte holds (high nibble first), in `dtype`."""
    k = (dtype, str(device))
    if k not in _PAIRS:
        lut, b = torch.tensor(CODES, dtype=dtype), torch.arange(256)
        _PAIRS[k] = torch.stack([lut[b >> 4], lut[b & 0xF]], dim=-1).to(device)
    return _PAIRS[k]


def dequantize(q: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Parts -> `out` (n,) in the factors' dtype (torchao's products, in that dtype)."""
    scales, factors = q["scales"], q["factors"]
    nb, groups = scales.numel(), factors.numel()
    padded = torch.zeros(groups * GROUP, dtype=torch.int8, device=scales.device)
    padded[:nb] = scales
    s = (padded.view(groups, GROUP) / factors.unsqueeze(-1)).reshape(-1)[:nb].to(factors.dtype)
    s = (s + q["mean"].reshape(())).unsqueeze(-1)  # (nb, 1)
    values = _pair_table(factors.dtype, q["codes"].device)[q["codes"].to(torch.int32)].view(-1, BLOCK)
    torch.mul(values, s, out=out.view(-1, BLOCK))
    return out
