"""NF4: 4-bit NormalFloat blocks with double-quantized scales, as QLoRA defines them.

Used by convert (quantize a tensor as it streams into the store), by the engine (dequantize a
streamed layer on the device) and by export (dequantize back to the compute dtype). The format
is torchao's NF4Tensor (tests check bitwise equality with it):

  * the flattened tensor is cut into blocks of BLOCK = 64 elements; each block is scaled by its
    absolute maximum and every element becomes the index of the nearest of the 16 NF4 code
    values (ties: the lower index), two indices per byte, the even element in the high nibble;
  * double quantization: the block absmaxes (one per block) have their mean subtracted and are
    quantized to int8 in groups of GROUP = 256 blocks, each group with the factor
    256 / (2 * group absmax);
  * dequantization: scale_b = int8_b / factor_g + mean, element = code_value * scale_b, all in
    the tensor's dtype (bf16 stores compute in bf16, as torchao does for a bf16 tensor).

One deliberate difference: a block of zeros (absmax 0) is stored as code 0.0 (torchao divides 0 by
0 and stores the code -1.0, which dequantizes to minus the block's double-quantized scale).

A tensor of n elements (n a multiple of BLOCK) is stored as four parts, each starting on an
ALIGN-byte boundary (`parts`): codes (n/2 bytes, uint8), scales (n/64 int8), factors
(ceil(n/64/256) values of the dtype), mean (one value of the dtype). A last group with fewer than
256 blocks is allowed (torchao refuses it): its factor is computed over the blocks it has.
"""

from __future__ import annotations

import torch

BLOCK = 64  # elements per absmax block
GROUP = 256  # blocks per double-quantization group
ALIGN = 64  # bytes: each part of a quantized tensor starts on this boundary

# The 16 NF4 code values (QLoRA appendix E, rounded to 4 decimals as torchao and QLoRA list them)
CODES = (
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
)  # fmt: skip


def _up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def quantizable(shape: tuple[int, ...]) -> bool:
    """Matrices (and stacked matrices) whose element count is whole blocks."""
    n = 1
    for d in shape:
        n *= d
    return len(shape) >= 2 and n > 0 and n % BLOCK == 0


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
        off = _up(off + n, ALIGN)
    return out


def nbytes(numel: int, itemsize: int) -> int:
    """Bytes of a quantized tensor, its last part padded to ALIGN."""
    p = parts(numel, itemsize)["mean"]
    return _up(p[0] + p[1], ALIGN)


_TABLES: dict[tuple[torch.dtype, str], torch.Tensor] = {}


def code_table(dtype: torch.dtype, device=None) -> torch.Tensor:
    """The 16 code values in `dtype` on `device` (made once per pair: no copy per layer)."""
    k = (dtype, str(torch.device(device) if device is not None else "cpu"))
    if k not in _TABLES:
        _TABLES[k] = torch.tensor(CODES, dtype=dtype).to(k[1])
    return _TABLES[k]


def _midpoints(dtype: torch.dtype) -> list[float]:
    """The 15 midpoints between consecutive code values (as rounded to `dtype`), in fp32."""
    lut = code_table(dtype).float()
    return ((lut[1:] + lut[:-1]) / 2).tolist()


_BY_VALUE: dict[tuple[torch.dtype, str], torch.Tensor] = {}


def _code_by_value(dtype: torch.dtype, device) -> torch.Tensor:
    """16-bit dtypes: the code of every one of the 65536 values, by torchao's own comparison
    (|value - code| in the dtype, the first minimum), so quantizing is one table look-up."""
    k = (dtype, str(device))
    if k not in _BY_VALUE:
        v = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
        v = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
        _BY_VALUE[k] = (
            (v.unsqueeze(-1) - code_table(dtype)).abs().min(dim=-1).indices.to(torch.uint8).to(device)
        )
    return _BY_VALUE[k]


def _nearest(scaled: torch.Tensor) -> torch.Tensor:
    """(n,) values in [-1, 1] -> (n,) code indices, as torchao's comparison against all 16 codes."""
    if scaled.element_size() == 2:
        bits = scaled.view(torch.int16).to(torch.int32) & 0xFFFF
        return _code_by_value(scaled.dtype, scaled.device)[bits]
    # fp32: the nearest code in exact arithmetic (how many midpoints lie below), then torchao's
    # comparison in the dtype among it and its neighbours (a tie keeps the lower index)
    lut = code_table(scaled.dtype, scaled.device)
    sf = scaled.float()
    near = torch.zeros(sf.shape, dtype=torch.uint8, device=scaled.device)
    for m in _midpoints(scaled.dtype):
        near += sf > m
    base = near.long()
    best, best_d = None, None
    for cand in (base - 1, base, base + 1):  # ascending
        c = cand.clamp(0, 15)
        d = (scaled - lut[c]).abs()
        if best is None or best_d is None:
            best, best_d = c, d
        else:
            better = d < best_d
            best, best_d = torch.where(better, c, best), torch.where(better, d, best_d)
    assert best is not None
    return best.to(torch.uint8)


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n,) (n a multiple of BLOCK) -> (packed codes (n/2,) uint8, block absmax (n/64,) x.dtype)."""
    blocks = x.view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks / absmax.unsqueeze(1)).reshape(-1)  # (n,) in x.dtype, as torchao divides
    scaled = torch.where(torch.isnan(scaled), torch.zeros_like(scaled), scaled)  # an all-zero block
    idx = _nearest(scaled)
    return (idx[0::2] << 4) | idx[1::2], absmax


def double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block absmaxes (nb,) -> (int8 scales (nb,), factors (ceil(nb/256),), mean ()), in absmax's
    dtype, as torchao's double_quantize_scalers (which needs nb to be a multiple of 256)."""
    mean = absmax.mean()
    centred = absmax - mean
    nb = centred.numel()
    groups = -(-nb // GROUP)
    padded = torch.zeros(groups * GROUP, dtype=centred.dtype, device=centred.device)
    padded[:nb] = centred  # zeros do not change a group's absmax
    gmax = padded.view(groups, GROUP).abs().amax(dim=1)
    gmax = torch.where(gmax == 0, torch.ones_like(gmax), gmax)  # every scale equal to the mean
    factor = 256 / (2 * gmax)
    q = (padded.view(groups, GROUP) * factor.unsqueeze(1)).round().clamp(-128, 127)
    return q.reshape(-1)[:nb].to(torch.int8), factor.contiguous(), mean


def dequantize_scales(scales: torch.Tensor, factors: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """(nb,) int8, (groups,), () -> (nb,) block scales in the factors' dtype (torchao's formula)."""
    nb = scales.numel()
    groups = factors.numel()
    padded = torch.zeros(groups * GROUP, dtype=torch.int8, device=scales.device)
    padded[:nb] = scales
    s = (padded.view(groups, GROUP) / factors.unsqueeze(-1)).reshape(-1)[:nb].to(factors.dtype)
    return s + mean


_PAIRS: dict[tuple[torch.dtype, str], torch.Tensor] = {}


def _pair_table(dtype: torch.dtype, device) -> torch.Tensor:
    """(256, 2): the two code values a packed byte holds (high nibble first), in `dtype`."""
    k = (dtype, str(device))
    if k not in _PAIRS:
        lut, b = code_table(dtype), torch.arange(256)
        _PAIRS[k] = torch.stack([lut[b >> 4], lut[b & 0xF]], dim=-1).to(device)
    return _PAIRS[k]


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, factors: torch.Tensor, mean: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Packed codes (n/2,) uint8 and the scale parts -> `out` (n,) in the factors' dtype: each
    byte looked up as its two code values at once, times its block's scale (torchao's products)."""
    s = dequantize_scales(scales, factors, mean).unsqueeze(-1)  # (nb, 1)
    values = _pair_table(factors.dtype, codes.device)[codes.to(torch.int32)].view(-1, BLOCK)  # (nb, 64)
    torch.mul(values, s, out=out.view(-1, BLOCK))
    return out


def quantize(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """A whole tensor (any shape, numel a multiple of BLOCK) -> its four parts."""
    codes, absmax = quantize_blocks(x.reshape(-1).contiguous())
    scales, factors, mean = double_quantize(absmax)
    return {"codes": codes, "scales": scales, "factors": factors, "mean": mean.reshape(1)}


def pack(q: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """Write the parts into `out` (nbytes,) uint8 at their offsets."""
    numel = q["codes"].numel() * 2
    item = q["factors"].element_size()
    for name, (off, n) in parts(numel, item).items():
        out[off : off + n] = q[name].reshape(-1).view(torch.uint8)


def unpack(buf: torch.Tensor, numel: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Views of the parts inside a quantized tensor's bytes (uint8)."""
    item = torch.empty((), dtype=dtype).element_size()
    p = parts(numel, item)
    view = {"codes": torch.uint8, "scales": torch.int8, "factors": dtype, "mean": dtype}
    return {k: buf[o : o + n].view(view[k]) for k, (o, n) in p.items()}


def dequantize_packed(buf: torch.Tensor, numel: int, dtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    q = unpack(buf, numel, dtype)
    return dequantize(q["codes"], q["scales"], q["factors"], q["mean"].reshape(()), out)
