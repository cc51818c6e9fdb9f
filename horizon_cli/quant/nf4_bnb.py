"""NF4 as bitsandbytes makes it: what `convert --quantize nf4` writes (store version 5).

The arithmetic of `bitsandbytes.functional.quantize_4bit(w, blocksize=64, quant_type="nf4",
compress_statistics=True)` and of `dequantize_4bit` on the CPU (bitsandbytes 0.50), which is how
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`
quantizes a linear weight: a QLoRA adapter trained on such a store meets the same base as peft on
a bitsandbytes 4-bit base. tests/quant/test_nf4.py checks every part bitwise against bitsandbytes.

  * the weight (in the store dtype, as bitsandbytes receives it) goes to fp32 and is cut into
    blocks of BLOCK = 64 elements; each element times 1/absmax of its block (clamped to [-1, 1])
    becomes the index of the nearest of the 16 NF4 code values (a tie: the lower index), two
    indices per byte, the even element in the high nibble;
  * double quantization: the fp32 block absmaxes minus their mean (`offset`) are quantized to 8
    bits in groups of GROUP = 256 blocks, each group scaled by its absmax (`absmax2`, fp32), onto
    bitsandbytes' signed dynamic map (`dynamic_map`, 256 values). The index is bitsandbytes' CPU
    rule: the normalised value picks one of 65536 evenly spaced bins over [-1, 1] and takes the
    code nearest to the bin's value (`lut`), not to the value itself (bitsandbytes' CUDA kernel
    searches the map directly, so a base quantized on a GPU differs in ~0.2% of these indices);
  * dequantization: block scale = dynamic[index] * absmax2 + offset (fp32, two roundings), element
    = nf4[code] * scale in fp32, rounded once to the store dtype.

A quantized tensor of n elements (n a multiple of BLOCK) is five parts, each on an ALIGN-byte
boundary (`parts`): codes (n/2 uint8), absmax (n/64 uint8), absmax2 (ceil(n/64/256) fp32),
offset (one fp32), dynamic (the 256 fp32 values of the map the indices refer to, as
bitsandbytes' QuantState carries it).
"""

from __future__ import annotations

import torch

BLOCK = 64  # elements per absmax block
GROUP = 256  # blocks per double-quantization group
ALIGN = 64  # bytes: each part starts on this boundary
BINS = 65536  # bitsandbytes' CPU lookup table for the 8-bit indices
CHUNK = 1 << 17  # blocks dequantized at once (8 Mi elements: bounds the fp32 temporaries)

# The 16 NF4 values (QLoRA appendix E) as the fp32 numbers bitsandbytes computes with
NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def dynamic_map() -> torch.Tensor:
    """(256,) fp32: the signed dynamic quantization map (Dettmers 2015, arXiv 1511.04561), 7
    exponent bits: for each exponent e in 0..6, 2**e fractions, the midpoints of 2**e + 1 points
    spaced evenly over [0.1, 1], times ±10**(e - 6); then 0 and 1; sorted."""
    vals = [0.0, 1.0]
    for e in range(7):
        edges = torch.linspace(0.1, 1, 2**e + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        vals += (10.0 ** (e - 6) * mids).tolist() + (-(10.0 ** (e - 6)) * mids).tolist()
    return torch.tensor(sorted(vals), dtype=torch.float32)


DYNAMIC = dynamic_map()


def _lut() -> torch.Tensor:
    """(BINS,) uint8: bin i (value -1 + 2i/(BINS-1), in fp32) -> the index of the dynamic code
    nearest to it (the midpoints below it counted; a value on a midpoint keeps the lower code)."""
    centre = torch.arange(BINS, dtype=torch.float32) * 2.0 / (BINS - 1) + -1.0
    mids = (DYNAMIC[:-1] + DYNAMIC[1:]) * 0.5
    return torch.searchsorted(mids, centre, right=False).to(torch.uint8)


LUT = _lut()
_MIDS = ((torch.tensor(NF4)[:-1] + torch.tensor(NF4)[1:]) / 2).tolist()  # the 15 fp32 midpoints


def _up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def parts(numel: int) -> dict[str, tuple[int, int]]:
    """Byte (offset, length) of each part of a quantized tensor of `numel` elements."""
    blocks = numel // BLOCK
    groups = -(-blocks // GROUP)
    out, off = {}, 0
    for name, n in (
        ("codes", numel // 2),
        ("absmax", blocks),
        ("absmax2", 4 * groups),
        ("offset", 4),
        ("dynamic", 1024),
    ):
        out[name] = (off, n)
        off = _up(off + n)
    return out


def nbytes(numel: int) -> int:
    """Bytes of a quantized tensor, its last part padded to ALIGN."""
    off, n = parts(numel)["dynamic"]
    return _up(off + n)


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n,) any float dtype, n a multiple of BLOCK -> (packed codes (n/2,) uint8, absmax (n/64,) fp32)."""
    blocks = x.reshape(-1, BLOCK).float()  # (nb, 64)
    absmax = blocks.abs().amax(dim=1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    # the index: how many of the 15 midpoints lie strictly below the value (on a midpoint: the
    # lower code), which is bitsandbytes' torch.bucketize; 15 elementwise passes, which torch
    # spreads over threads, are faster than bucketize's binary search, which it does not
    idx = torch.zeros(scaled.shape, dtype=torch.uint8, device=x.device)  # on x's device (a resident copy's)
    above = torch.empty(scaled.shape, dtype=torch.bool, device=x.device)
    for m in _MIDS:
        torch.gt(scaled, m, out=above)
        idx.add_(above.view(torch.uint8))
    return (idx[0::2] << 4) | idx[1::2], absmax


def double_quantize(absmax: torch.Tensor) -> dict[str, torch.Tensor]:
    """Block absmaxes (nb,) fp32 -> the scale parts: absmax (nb,) uint8, absmax2 (groups,) fp32,
    offset (1,) fp32, dynamic (256,) fp32."""
    offset = absmax.mean()
    nb = absmax.numel()
    groups = -(-nb // GROUP)
    centred = torch.zeros(groups * GROUP, dtype=torch.float32, device=absmax.device)
    centred[:nb] = absmax - offset  # a short last group: its zeros change no absmax
    centred = centred.view(groups, GROUP)
    gmax = centred.abs().amax(dim=1)  # (groups,)
    inv = torch.where(gmax == 0, torch.zeros_like(gmax), 1.0 / gmax)
    v = torch.clamp(centred * inv.unsqueeze(1), -1, 1)
    bins = ((v + 1.0) * 0.5 * (BINS - 1) + 0.5).to(torch.int32)  # truncation, as bitsandbytes
    q = LUT.to(absmax.device)[bins.long()]
    q[gmax == 0] = 0  # bitsandbytes writes index 0 for a group whose absmax is 0
    return {
        "absmax": q.reshape(-1)[:nb].contiguous(),
        "absmax2": gmax,
        "offset": offset.reshape(1),
        "dynamic": DYNAMIC.to(absmax.device),
    }


def quantize(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """A whole tensor (numel a multiple of BLOCK) -> its five parts."""
    codes, absmax = quantize_blocks(x.reshape(-1))
    return {"codes": codes, **double_quantize(absmax)}


def pack(q: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """Write the parts into `out` (nbytes,) uint8 at their offsets."""
    for name, (off, n) in parts(q["codes"].numel() * 2).items():
        out[off : off + n] = q[name].reshape(-1).view(torch.uint8)


def unpack(buf: torch.Tensor, numel: int) -> dict[str, torch.Tensor]:
    """Views of the parts inside a quantized tensor's bytes (uint8)."""
    view = {
        "codes": torch.uint8,
        "absmax": torch.uint8,
        "absmax2": torch.float32,
        "offset": torch.float32,
        "dynamic": torch.float32,
    }
    return {k: buf[o : o + n].view(view[k]) for k, (o, n) in parts(numel).items()}


_PAIRS: dict[str, torch.Tensor] = {}


def _pair_table(device) -> torch.Tensor:
    """(256, 2) fp32: the two NF4 values a packed byte holds (high nibble first), made once per device."""
    k = str(device)
    if k not in _PAIRS:
        lut, b = torch.tensor(NF4, dtype=torch.float32), torch.arange(256)
        _PAIRS[k] = torch.stack([lut[b >> 4], lut[b & 0xF]], dim=-1).to(device)
    return _PAIRS[k]


def block_scales(q: dict[str, torch.Tensor]) -> torch.Tensor:
    """(nb,) fp32: each block's absmax as bitsandbytes dequantizes it."""
    nb = q["absmax"].numel()
    group = q["absmax2"].repeat_interleave(GROUP)[:nb]
    return q["dynamic"][q["absmax"].to(torch.int32)] * group + q["offset"]


def dequantize(q: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Parts (on out's device) -> `out` (n,) in its dtype: nf4[code] * scale in fp32, rounded once
    to out's dtype; CHUNK blocks at a time."""
    scale = block_scales(q).unsqueeze(-1)  # (nb, 1)
    pairs = _pair_table(out.device)
    codes, dst = q["codes"].view(-1, BLOCK // 2), out.view(-1, BLOCK)
    for a in range(0, dst.shape[0], CHUNK):
        vals = pairs[codes[a : a + CHUNK].long()].view(-1, BLOCK)  # (chunk, 64) fp32
        # fp32 products, each rounded once into out's dtype (TensorIterator casts on the store)
        torch.mul(vals, scale[a : a + CHUNK], out=dst[a : a + CHUNK])
    return out
