"""NF4 weights in a store: which layout a quantized tensor's bytes hold, and one entry point for
each use. Used by convert (quantize a tensor as it streams into the store), the engine
(dequantize a streamed layer on the device) and export (dequantize back to the store dtype).

Two layouts (schemes), recorded per store by its manifest version (store/packed.py: scheme_of):

    "bnb"      bitsandbytes' NF4 with double quantization (nf4_bnb.py): what convert writes,
               store version 5
    "torchao"  horizon's layout before version 5, torchao's arithmetic (nf4_torchao.py):
               versions 3 and 4, read only

`dequantize_packed` takes the scheme, or tells it from the region's length when it is not given
(a bnb region always holds its 1 KiB dynamic map and fp32 scales, so it is longer than a
torchao region of the same tensor in any store dtype).
"""

from __future__ import annotations

import torch

from . import nf4_bnb, nf4_torchao

BLOCK = 64  # elements per absmax block (both schemes)
SCHEME = "bnb"  # what new stores hold
SCHEMES = ("bnb", "torchao")

quantize_blocks = nf4_bnb.quantize_blocks  # (n,) -> (packed codes, fp32 block absmax): convert streams these
double_quantize = nf4_bnb.double_quantize  # all block absmaxes -> the scale parts, in layout order
quantize = nf4_bnb.quantize  # a whole tensor -> its parts
pack = nf4_bnb.pack


def quantizable(shape: tuple[int, ...]) -> bool:
    """Matrices (and stacked matrices) whose element count is whole blocks."""
    n = 1
    for d in shape:
        n *= d
    return len(shape) >= 2 and n > 0 and n % BLOCK == 0


def parts(numel: int, itemsize: int, scheme: str = SCHEME) -> dict[str, tuple[int, int]]:
    """Byte (offset, length) of each part of a quantized tensor, in file order."""
    return nf4_bnb.parts(numel) if scheme == "bnb" else nf4_torchao.parts(numel, itemsize)


def nbytes(numel: int, itemsize: int, scheme: str = SCHEME) -> int:
    """Bytes of a quantized tensor's region (ALIGN padded) in a store of that itemsize."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown NF4 scheme {scheme!r}")
    return nf4_bnb.nbytes(numel) if scheme == "bnb" else nf4_torchao.nbytes(numel, itemsize)


def scheme_of_region(nbytes_: int, numel: int, itemsize: int) -> str:
    """Which scheme a region of `nbytes_` bytes holding `numel` elements is."""
    for s in SCHEMES:
        if nbytes(numel, itemsize, s) == nbytes_:
            return s
    raise ValueError(f"{nbytes_} bytes are no NF4 region of {numel} elements")


def dequantize_packed(
    buf: torch.Tensor, numel: int, dtype: torch.dtype, out: torch.Tensor, scheme: str | None = None
) -> torch.Tensor:
    """A quantized tensor's region (uint8, on any device) -> `out` ((numel,), `dtype` = the store
    dtype, same device): the tensor as its scheme dequantizes it."""
    if scheme is None:
        scheme = scheme_of_region(buf.numel(), numel, dtype.itemsize)
    if scheme == "bnb":
        return nf4_bnb.dequantize(nf4_bnb.unpack(buf, numel), out)
    if scheme == "torchao":
        return nf4_torchao.dequantize(nf4_torchao.unpack(buf, numel, dtype), out)
    raise ValueError(f"unknown NF4 scheme {scheme!r}")
