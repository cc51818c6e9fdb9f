"""Host state layout per memory mode: which optimizer state each element of a unit has, and where.

The optimizer state comes in kinds, each over element ranges of the unit (`Segment`s) and held in
buffers packed per kind:

  exact   lo (int16, bf16 runs: the fp32 master's low half, optim.split), m, v (fp32)
  lean    lo8 (int8), qm, qw (uint8), sm, sw (fp32 per block of 64): optim/lean.py
  frozen  no state (elements past the layout's trainable_numel, e.g. a routing bias)

A memory mode (optim/modes.py) picks one of two layouts (`state_layout`, the one place):
`WholeExact` (optim.memory: exact) is one exact segment over the whole unit, its buffers spanning
every element, as it always was; `PackedKinds` (lean) makes every matrix lean and keeps 1-D
tensors (norm scales, biases: under 0.1 % of a model) exact: a norm scale near 1.0 takes updates
of about lr, which a 16-significant-bit master would round away.

Sharded runs hold elements [a, b) of a unit: `clip` cuts the segments to them and names each
kind's global range [lo, hi) of its packed buffers (packing keeps element order); `ranges` gives
every buffer's global range, by which checkpoints are written and read at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import torch

from ..optim import lean
from ..optim.modes import MemoryMode, memory_mode
from ..optim.split import join, split_
from ..store import UnitLayout

LEAN_BLOCK = lean.BLOCK


class StateKind(StrEnum):
    """The optimizer state an element has (module doc); its value names it in checkpoints' docs."""

    EXACT = "exact"
    LEAN = "lean"


@dataclass(frozen=True)
class Segment:
    kind: StateKind
    start: int  # elements [start, end) of the unit
    end: int
    at: int  # where the range begins in its kind's packed buffers

    @property
    def numel(self) -> int:
        return self.end - self.start


KindRanges = dict[StateKind, tuple[int, int]]  # per kind: the global range [lo, hi) a shard holds
BufferRanges = dict[str, tuple[int, int, int]]  # per buffer key: (global lo, global hi, global length)
Buffers = dict[str, torch.Tensor]


def stays_exact(shape: tuple[int, ...]) -> bool:
    """In lean units: the tensors kept exact (1-D: norm scales and biases)."""
    return len(shape) <= 1


def kind_numel(segs: list[Segment], kind: StateKind) -> int:
    return sum(s.numel for s in segs if s.kind == kind)


def _before(segs: list[Segment], kind: StateKind, x: int) -> int:
    """Elements of `kind` before element x: where x falls in that kind's packed buffers."""
    return sum(min(max(x - s.start, 0), s.numel) for s in segs if s.kind == kind)


def _clip(segs: list[Segment], a: int, b: int, kinds: KindRanges) -> list[Segment]:
    """The segments' parts inside the shard [a, b), rebased to it and to the kinds' ranges."""
    out = []
    for s in segs:
        x, y = max(s.start, a), min(s.end, b)
        if x < y:
            out.append(Segment(s.kind, x - a, y - a, s.at + (x - s.start) - kinds[s.kind][0]))
    return out


class StateLayout(Protocol):
    """What a memory mode's host state looks like for one unit (module doc)."""

    def segments(self, layout: UnitLayout) -> list[Segment]:
        """The unit's trainable elements [0, trainable_numel) as runs of one state kind."""
        ...

    def clip(self, segs: list[Segment], a: int, b: int) -> tuple[list[Segment], KindRanges]:
        """The segments inside the shard [a, b), and per kind the packed range it holds."""
        ...

    def ranges(self, n: int, a: int, b: int, totals: dict[StateKind, int], kinds: KindRanges) -> BufferRanges:
        """Per buffer key: its global range, for a shard [a, b) of a unit of n elements."""
        ...

    def alloc(self, n: int, bf16: bool, totals: dict[StateKind, int], kinds: KindRanges) -> Buffers:
        """The zeroed state buffers of a shard of n elements (bf16: the stream is bf16)."""
        ...

    def master(self, stream: torch.Tensor, state: Buffers, segs: list[Segment]) -> torch.Tensor:
        """The fp32 master weights (numel,) of a bf16 stream and its state: a copy."""
        ...

    def set_master(
        self, master: torch.Tensor, stream: torch.Tensor, state: Buffers, segs: list[Segment]
    ) -> None:
        """Write fp32 master weights into a bf16 stream and its state, rounded as kept."""
        ...


class WholeExact:
    """optim.memory: exact — one exact segment; its state spans the whole unit, frozen elements too."""

    def segments(self, layout: UnitLayout) -> list[Segment]:
        n = layout.trainable_numel
        return [Segment(StateKind.EXACT, 0, n, 0)] if n else []

    def clip(self, segs: list[Segment], a: int, b: int) -> tuple[list[Segment], KindRanges]:
        kinds = {StateKind.EXACT: (a, b)}
        return _clip(segs, a, b, kinds), kinds

    def ranges(self, n: int, a: int, b: int, totals: dict[StateKind, int], kinds: KindRanges) -> BufferRanges:
        return {key: (a, b, n) for key in ("stream", "grad", "lo", "m", "v")}

    def alloc(self, n: int, bf16: bool, totals: dict[StateKind, int], kinds: KindRanges) -> Buffers:
        return exact_state(n, bf16)

    def master(self, stream: torch.Tensor, state: Buffers, segs: list[Segment]) -> torch.Tensor:
        return join(stream, state["lo"])

    def set_master(
        self, master: torch.Tensor, stream: torch.Tensor, state: Buffers, segs: list[Segment]
    ) -> None:
        split_(master, stream, state["lo"])


class PackedKinds:
    """optim.memory: lean — matrices lean, 1-D tensors exact, each kind's state packed apart."""

    def segments(self, layout: UnitLayout) -> list[Segment]:
        n = layout.trainable_numel
        if n % LEAN_BLOCK:
            raise ValueError(f"{layout.name}: {n} trainable elements is not a multiple of {LEAN_BLOCK}")
        exact = sorted(  # whole blocks: tensors start on block boundaries (the layout's alignment)
            (p.offset // LEAN_BLOCK * LEAN_BLOCK, min(n, -(-(p.offset + p.numel) // LEAN_BLOCK) * LEAN_BLOCK))
            for p in layout.tensors
            if p.trainable and stays_exact(p.shape)
        )
        runs: list[tuple[StateKind, int, int]] = []
        pos = 0
        for a, b in exact:
            if a > pos:
                runs.append((StateKind.LEAN, pos, a))
            if runs and runs[-1][0] == StateKind.EXACT and runs[-1][2] >= a:
                runs[-1] = (StateKind.EXACT, runs[-1][1], max(runs[-1][2], b))
            elif b > max(a, pos):
                runs.append((StateKind.EXACT, max(a, pos), b))
            pos = max(pos, b)
        if pos < n:
            runs.append((StateKind.LEAN, pos, n))
        out, used = [], dict.fromkeys(StateKind, 0)
        for kind, a, b in runs:
            out.append(Segment(kind, a, b, used[kind]))
            used[kind] += b - a
        return out

    def clip(self, segs: list[Segment], a: int, b: int) -> tuple[list[Segment], KindRanges]:
        kinds = {k: (_before(segs, k, a), _before(segs, k, b)) for k in StateKind}
        return _clip(segs, a, b, kinds), kinds

    def ranges(self, n: int, a: int, b: int, totals: dict[StateKind, int], kinds: KindRanges) -> BufferRanges:
        (elo, ehi), (llo, lhi) = kinds[StateKind.EXACT], kinds[StateKind.LEAN]
        out = {"stream": (a, b, n), "grad": (a, b, n)}
        for key in ("lo", "m", "v"):
            out[key] = (elo, ehi, totals[StateKind.EXACT])
        for key in ("lo8", "qm", "qw"):
            out[key] = (llo, lhi, totals[StateKind.LEAN])
        for key in ("sm", "sw"):
            out[key] = (llo // LEAN_BLOCK, lhi // LEAN_BLOCK, totals[StateKind.LEAN] // LEAN_BLOCK)
        return out

    def alloc(self, n: int, bf16: bool, totals: dict[StateKind, int], kinds: KindRanges) -> Buffers:
        (elo, ehi), (llo, lhi) = kinds[StateKind.EXACT], kinds[StateKind.LEAN]
        has = (totals[StateKind.EXACT] > 0, totals[StateKind.LEAN] > 0)
        return lean_state(ehi - elo, lhi - llo, has)

    def master(self, stream: torch.Tensor, state: Buffers, segs: list[Segment]) -> torch.Tensor:
        out = stream.float()  # frozen elements: the stream is all there is
        for s in segs:
            exact = s.kind == StateKind.EXACT
            lo = state["lo" if exact else "lo8"][s.at : s.at + s.numel]
            pair = join if exact else lean.join24
            out[s.start : s.end] = pair(stream[s.start : s.end], lo)
        return out

    def set_master(
        self, master: torch.Tensor, stream: torch.Tensor, state: Buffers, segs: list[Segment]
    ) -> None:
        stream.copy_(master)  # frozen elements: rounded to the stream's dtype
        for s in segs:
            exact = s.kind == StateKind.EXACT
            lo = state["lo" if exact else "lo8"][s.at : s.at + s.numel]
            put = split_ if exact else lean.split24_
            put(master[s.start : s.end], stream[s.start : s.end], lo)


def state_layout(mode: MemoryMode) -> StateLayout:
    """The layout a memory mode holds its state in: the one place a mode picks it."""
    return PackedKinds() if mode.packed else WholeExact()


def segments(layout: UnitLayout, memory: MemoryMode | str) -> list[Segment]:
    """The unit's trainable elements as runs of one state kind, under a mode (or its word)."""
    return state_layout(memory_mode(memory)).segments(layout)


def exact_state(numel: int, bf16: bool) -> Buffers:
    out = {"m": torch.zeros(numel, dtype=torch.float32), "v": torch.zeros(numel, dtype=torch.float32)}
    if bf16:
        out = {"lo": torch.zeros(numel, dtype=torch.int16), **out}
    return out


def lean_state(n_exact: int, n_lean: int, kinds: tuple[bool, bool] | None = None) -> Buffers:
    """Packed buffers of a lean unit: the exact kind's for its 1-D tensors, then the lean kind's.
    kinds: whether the unit has each kind at all (a shard may hold none of one: empty buffers)."""
    has_exact, has_lean = kinds if kinds is not None else (n_exact > 0, n_lean > 0)
    out = exact_state(n_exact, True) if has_exact else {}
    if has_lean:
        out["lo8"] = torch.zeros(n_lean, dtype=torch.int8)
        out["qm"] = torch.zeros(n_lean, dtype=torch.uint8)
        out["qw"] = torch.zeros(n_lean, dtype=torch.uint8)
        out["sm"] = torch.zeros(n_lean // LEAN_BLOCK, dtype=torch.float32)
        out["sw"] = torch.zeros(n_lean // LEAN_BLOCK, dtype=torch.float32)
    return out
