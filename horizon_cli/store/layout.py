"""Unit layouts: where each tensor sits inside its unit's flat buffer.

A unit (embedding, one decoder layer, head) is one contiguous buffer so that it moves to a
device in a single copy. Offsets are counted in elements and aligned to ALIGN elements, so the
same layout serves the streaming copy (bf16) and the fp32 master, moments and gradients, which
mirror it element for element. Padding elements are zero and stay zero under AdamW.

Two views of one buffer: *slots* are the checkpoint's tensors (what convert writes, export reads
and checksums cover), *params* the tensors the engine computes with. On the native path they are
the same. On the generic path a param is transformers' in-memory tensor, and the checkpoint
tensors that fill it (e.g. every expert's `gate_proj` and `up_proj` for a fused
`experts.gate_up_proj` (E, 2I, H)) sit back to back inside its region, so the param is a view.
Frozen params (persistent buffers such as DeepSeek-V3's routing bias) come after every trainable
one; `trainable_numel` is where the optimizer stops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..arch import ArchSpec, unit_names, unit_tensors
from ..arch.names import generic_table, part_name
from ..errors import InputError

ALIGN = 64  # elements: 128 B in bf16, 256 B in fp32 — whole cache lines and SIMD vectors
PAGE = 4096


@dataclass(frozen=True)
class Slot:
    name: str
    hf: str
    shape: tuple[int, ...]
    offset: int  # elements from the start of the unit
    numel: int
    dtype: str | None = None  # an integer tensor held in the float unit (arch.generic._mark_integers)


@dataclass(frozen=True)
class Param:
    name: str  # what the engine calls it: native store name, or the module-relative name
    hf: str  # transformers' in-memory name, e.g. "model.layers.3.mlp.experts.gate_up_proj"
    shape: tuple[int, ...]
    offset: int
    numel: int
    trainable: bool = True
    dtype: str | None = None  # an integer tensor held in the float unit


@dataclass(frozen=True)
class UnitLayout:
    name: str
    slots: tuple[Slot, ...]
    numel: int  # padded total, a multiple of ALIGN
    tensors: tuple[Param, ...] = ()  # the engine's view (= slots on the native path)
    trainable_numel: int = 0  # elements [0, trainable_numel) are trained; the rest is frozen

    def slot(self, name: str) -> Slot:
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(f"{self.name} has no tensor {name!r}")

    @property
    def params(self) -> int:
        return sum(s.numel for s in self.slots)


def round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def unit_layout(spec: ArchSpec, unit: str) -> UnitLayout:
    return spec.pick(_native_layout, _generic_layout)(spec, unit)


def _native_layout(spec: ArchSpec, unit: str) -> UnitLayout:
    slots, off = [], 0
    for t in unit_tensors(spec, unit):
        n = math.prod(t.shape)
        slots.append(Slot(t.name, t.hf, tuple(t.shape), off, n))
        off = round_up(off + n, ALIGN)
    params = tuple(Param(s.name, s.hf, s.shape, s.offset, s.numel) for s in slots)
    numel = max(off, ALIGN)
    return UnitLayout(unit, tuple(slots), numel, params, numel)


def _generic_layout(spec: ArchSpec, unit: str) -> UnitLayout:
    """Each in-memory tensor gets an aligned region; its checkpoint tensors fill it back to back. The
    tensors of a group (`after`: split from one checkpoint tensor) share one region, each right
    after the one it follows, so that checkpoint tensor stays contiguous."""
    slots: list[Slot] = []
    params: list[Param] = []
    end, trained = 0, 0
    for e in generic_table(spec, unit):
        shape = e.shape
        n = math.prod(shape)
        joined = e.after is not None
        if joined and (not params or params[-1].hf != e.after):
            raise InputError(
                f"store manifest: unit {unit}: {e.hf} is not right after {e.after}, which it follows"
            )
        off = end if joined else round_up(end, ALIGN)
        params.append(Param(e.name, e.hf, shape, off, n, bool(e.trainable), e.dtype))
        for k, p in enumerate(e.parts):
            slots.append(Slot(part_name(e, k), p.hf, p.shape, off + p.at, math.prod(p.shape), e.dtype))
        end = off + n
        if e.trainable:
            trained = round_up(end, ALIGN)
    slots.sort(key=lambda s: s.offset)
    return UnitLayout(unit, tuple(slots), max(round_up(end, ALIGN), ALIGN), tuple(params), trained)


def layouts(spec: ArchSpec) -> list[UnitLayout]:
    return [unit_layout(spec, u) for u in unit_names(spec)]


def file_bytes(numel: int, itemsize: int) -> int:
    """Unit files are padded to whole pages so each maps and reads page-aligned."""
    return round_up(numel * itemsize, PAGE)
