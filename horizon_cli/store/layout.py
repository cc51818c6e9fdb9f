"""Unit layouts: where each tensor sits inside its unit's flat buffer.

A unit (embedding, one decoder layer, head) is one contiguous buffer so that it moves to a
device in a single copy. Offsets are counted in elements and aligned to ALIGN elements, so the
same layout serves the streaming copy (bf16) and the fp32 master, moments and gradients, which
mirror it element for element. Padding elements are zero and stay zero under AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..arch import ArchSpec, unit_names, unit_tensors

ALIGN = 64  # elements: 128 B in bf16, 256 B in fp32 — whole cache lines and SIMD vectors
PAGE = 4096


@dataclass(frozen=True)
class Slot:
    name: str
    hf: str
    shape: tuple[int, ...]
    offset: int  # elements from the start of the unit
    numel: int


@dataclass(frozen=True)
class UnitLayout:
    name: str
    slots: tuple[Slot, ...]
    numel: int  # padded total, a multiple of ALIGN

    def slot(self, name: str) -> Slot:
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(f"{self.name} has no tensor {name!r}")

    @property
    def params(self) -> int:
        return sum(s.numel for s in self.slots)


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def unit_layout(spec: ArchSpec, unit: str) -> UnitLayout:
    slots, off = [], 0
    for t in unit_tensors(spec, unit):
        n = 1
        for d in t.shape:
            n *= d
        slots.append(Slot(t.name, t.hf, tuple(t.shape), off, n))
        off = _round_up(off + n, ALIGN)
    return UnitLayout(unit, tuple(slots), max(off, ALIGN))


def layouts(spec: ArchSpec) -> list[UnitLayout]:
    return [unit_layout(spec, u) for u in unit_names(spec)]


def file_bytes(numel: int, itemsize: int) -> int:
    """Unit files are padded to whole pages so each maps and reads page-aligned."""
    return _round_up(numel * itemsize, PAGE)
