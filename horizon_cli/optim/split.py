"""fp32 master weights stored as a bf16 streaming copy plus a 16-bit remainder.

An fp32 value's bit pattern u splits into hi = round(u >> 16) (a bf16, round to nearest with
ties away from zero) and lo = u - (hi << 16), a signed 16-bit remainder in [-2^15, 2^15). hi is the
bf16 copy the device streams; (hi, lo) together hold the fp32 master exactly, so the master costs
2 extra bytes per parameter instead of 4. Pure-torch reference; kernels/adamw.cpp does the same
in one pass.
"""

from __future__ import annotations

import torch


def join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """(bf16 hi, int16 lo) -> fp32 master, exactly.  Shapes: (N,), (N,) -> (N,)."""
    u = (hi.view(torch.int16).to(torch.int32) << 16) + lo.to(torch.int32)
    return u.view(torch.float32)


def split_(master: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """fp32 master -> (bf16 hi, int16 lo) written in place."""
    u = master.contiguous().view(torch.int32)
    h = (u + 0x8000) >> 16  # arithmetic shift: the sign-extended upper half, rounded
    lo.copy_((u - (h << 16)).to(torch.int16))
    hi.view(torch.int16).copy_(h.to(torch.int16))
