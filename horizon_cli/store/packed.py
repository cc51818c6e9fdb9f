"""Packed units: the byte layout of a decoder layer in a quantized (NF4) store.

A quantized store keeps the element layout of every unit (store.layout: where each tensor sits in
the dense buffer the engine computes with) and adds, for decoder layers, a byte layout of the unit
file: each slot (checkpoint tensor) is a region of its own, starting on a REGION-byte boundary,
holding either the tensor's raw bytes in the store dtype (norms, biases, tensors that are not whole
NF4 blocks) or its NF4 parts (quant/nf4.py). The embedding and the head stay dense and keep the
plain layout. A packed layer crosses the link as these bytes and is dequantized into the dense
layout on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..quant import nf4
from .layout import UnitLayout

REGION = 128  # bytes


@dataclass(frozen=True)
class PackedSlot:
    name: str
    hf: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the unit file
    nbytes: int
    numel: int
    dense: int  # element offset of the tensor in the dense layout
    quant: str  # "" (raw, store dtype) | "nf4"


@dataclass(frozen=True)
class PackedLayout:
    name: str
    slots: tuple[PackedSlot, ...]
    nbytes: int  # bytes of the unit, REGION aligned

    def slot(self, name: str) -> PackedSlot:
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(f"{self.name} has no tensor {name!r}")


def _up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def packs(unit: str, quant: str) -> bool:
    """Which units a store with `quant` packs: decoder layers only."""
    return bool(quant) and unit.startswith("layer.")


def packed_layout(lay: UnitLayout, itemsize: int, quant: str) -> PackedLayout:
    if quant != "nf4":
        raise ValueError(f"unknown quantization {quant!r}")
    out, off = [], 0
    for s in lay.slots:
        q = "nf4" if nf4.quantizable(s.shape) else ""
        n = nf4.nbytes(s.numel, itemsize) if q else s.numel * itemsize
        out.append(PackedSlot(s.name, s.hf, s.shape, off, n, s.numel, s.offset, q))
        off = _up(off + n, REGION)
    return PackedLayout(lay.name, tuple(out), max(off, REGION))
