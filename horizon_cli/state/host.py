"""Host training state: per unit, the streaming copy, the gradients, and the optimizer state.

Every buffer is flat and, for the streaming copy and the gradient, mirrors the unit's layout
element for element, in anonymous memory (pinned on CUDA) that the kernel never writes back to a
file on its own (invariant 7):

  stream  (numel,) compute dtype   what the device streams; in fp32 exact runs it *is* the master
                                   (lean: always bf16, its storage format; a run computing in
                                   fp32 upcasts it on the device, state.widen)
  grad    (numel,) grad dtype      gradients of the step, kept whole until the clip norm is known:
                                   accumulated in fp32 on the device, sent in `engine.grad_dtype`
                                   (bf16 runs: bf16, half the device->host traffic); the embedding's
                                   grad is always fp32, because the host accumulates it row by row

The optimizer state comes in kinds, each over element ranges of the unit (`Segment`s) and held in
buffers packed per kind (`optim.memory` picks them):

  exact   lo (int16, bf16 runs: the fp32 master's low half, optim.split), m, v (fp32)
  lean    lo8 (int8), qm, qw (uint8), sm, sw (fp32 per block of 64): optim/lean.py
  frozen  no state (elements past the layout's trainable_numel, e.g. a routing bias)

`optim.memory: exact` is one exact segment over the whole unit, as it always was. `lean` makes
every matrix lean and keeps 1-D tensors (norm scales, biases: under 0.1 % of a model) exact: a
norm scale near 1.0 takes updates of about lr, which a 16-significant-bit master would round away.

Host bytes per parameter: exact bf16 2 + 2 + 4 + 4 + 2 = 14, fp32 4 + 4 + 4 + 4 = 16; lean
2 + 1 + 1 + 1 + 8/64 + 2 = 7.125.

Sharded runs (`shard=(world, rank)`, parallel/): a rank holds elements [start, end) of every unit
(parallel.shard.shard_range with SHARD_ALIGN, so lean blocks never straddle ranks) and the matching
contiguous part of every buffer: the stream, the gradient, and of each state kind's packed
buffers the range its elements occupy there (packing keeps element order). `UnitState.ranges`
names each buffer's global range, by which checkpoints are written and read at any world size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..optim import lean
from ..optim.split import join, split_
from ..parallel.shard import SHARD_ALIGN, shard_range
from ..store import Store, UnitLayout

LEAN_BLOCK = lean.BLOCK


@dataclass(frozen=True)
class Segment:
    kind: str  # "exact" | "lean"
    start: int  # elements [start, end) of the unit
    end: int
    at: int  # where the range begins in its kind's packed buffers

    @property
    def numel(self) -> int:
        return self.end - self.start


def stays_exact(shape: tuple[int, ...]) -> bool:
    """In lean units: the tensors kept exact (1-D: norm scales and biases)."""
    return len(shape) <= 1


def segments(layout: UnitLayout, memory: str) -> list[Segment]:
    """The unit's trainable elements [0, trainable_numel) as runs of one state kind."""
    n = layout.trainable_numel
    if memory == "exact":
        return [Segment("exact", 0, n, 0)] if n else []
    if n % LEAN_BLOCK:
        raise ValueError(f"{layout.name}: {n} trainable elements is not a multiple of {LEAN_BLOCK}")
    exact = sorted(  # whole blocks: tensors start on block boundaries (the layout's alignment)
        (p.offset // LEAN_BLOCK * LEAN_BLOCK, min(n, -(-(p.offset + p.numel) // LEAN_BLOCK) * LEAN_BLOCK))
        for p in layout.tensors
        if p.trainable and stays_exact(p.shape)
    )
    runs: list[tuple[str, int, int]] = []
    pos = 0
    for a, b in exact:
        if a > pos:
            runs.append(("lean", pos, a))
        if runs and runs[-1][0] == "exact" and runs[-1][2] >= a:
            runs[-1] = ("exact", runs[-1][1], max(runs[-1][2], b))
        elif b > max(a, pos):
            runs.append(("exact", max(a, pos), b))
        pos = max(pos, b)
    if pos < n:
        runs.append(("lean", pos, n))
    out, used = [], {"exact": 0, "lean": 0}
    for kind, a, b in runs:
        out.append(Segment(kind, a, b, used[kind]))
        used[kind] += b - a
    return out


def kind_numel(segs: list[Segment], kind: str) -> int:
    return sum(s.numel for s in segs if s.kind == kind)


def _before(segs: list[Segment], kind: str, x: int) -> int:
    """Elements of `kind` before element x: where x falls in that kind's packed buffers."""
    return sum(min(max(x - s.start, 0), s.numel) for s in segs if s.kind == kind)


def clip_segments(segs: list[Segment], a: int, b: int, memory: str) -> tuple[list[Segment], dict]:
    """The segments' parts inside the shard [a, b), rebased to it, and per state kind the global
    range [lo, hi) of its packed buffers the shard holds. An exact unit's state spans the whole
    unit (frozen elements included), so its range is [a, b) itself."""
    kinds = {"exact": (a, b)} if memory == "exact" else {
        k: (_before(segs, k, a), _before(segs, k, b)) for k in ("exact", "lean")
    }  # fmt: skip
    out = []
    for s in segs:
        x, y = max(s.start, a), min(s.end, b)
        if x < y:
            out.append(Segment(s.kind, x - a, y - a, s.at + (x - s.start) - kinds[s.kind][0]))
    return out, kinds


def buffer_ranges(memory: str, n: int, a: int, b: int, totals: dict, kinds: dict) -> dict:
    """Per buffer key: (global lo, global hi, global length) in that buffer's elements."""
    out = {"stream": (a, b, n), "grad": (a, b, n)}
    if memory == "exact":
        for key in ("lo", "m", "v"):
            out[key] = (a, b, n)
        return out
    (elo, ehi), (llo, lhi) = kinds["exact"], kinds["lean"]
    for key in ("lo", "m", "v"):
        out[key] = (elo, ehi, totals["exact"])
    for key in ("lo8", "qm", "qw"):
        out[key] = (llo, lhi, totals["lean"])
    for key in ("sm", "sw"):
        out[key] = (llo // LEAN_BLOCK, lhi // LEAN_BLOCK, totals["lean"] // LEAN_BLOCK)
    return out


@dataclass
class UnitState:
    name: str
    layout: UnitLayout
    kind: str  # the unit's optim.memory: "exact" (one segment, buffers over the whole unit) | "lean"
    stream: torch.Tensor
    grad: torch.Tensor
    segments: list[Segment]
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # packed per kind, see the module doc
    start: int = 0  # sharded runs: the first element of the unit this rank holds (its `stream[0]`)
    ranges: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # buffer -> (lo, hi, length)

    @property
    def full_numel(self) -> int:
        """The whole unit's stream length (a sharded rank holds `ranges["stream"]` of it)."""
        return self.ranges["stream"][2] if self.ranges else self.stream.numel()

    @property
    def lo(self) -> torch.Tensor | None:
        return self.state.get("lo")

    def master(self) -> torch.Tensor:
        """The fp32 master weights, (numel,): a copy (the stream itself in fp32 exact runs)."""
        if self.stream.dtype == torch.float32:
            return self.stream
        if self.kind == "exact":
            return join(self.stream, self.state["lo"])
        out = self.stream.float()  # frozen elements: the stream is all there is
        for s in self.segments:
            lo = self.state["lo" if s.kind == "exact" else "lo8"][s.at : s.at + s.numel]
            pair = join if s.kind == "exact" else lean.join24
            out[s.start : s.end] = pair(self.stream[s.start : s.end], lo)
        return out

    def set_master(self, master: torch.Tensor) -> None:
        """Write fp32 master weights (numel,) into the stream and the state, rounded as kept."""
        if self.stream.dtype == torch.float32:
            self.stream.copy_(master)
        elif self.kind == "exact":
            split_(master, self.stream, self.state["lo"])
        else:
            self.stream.copy_(master)  # frozen elements: rounded to the stream's dtype
            for s in self.segments:
                lo = self.state["lo" if s.kind == "exact" else "lo8"][s.at : s.at + s.numel]
                put = split_ if s.kind == "exact" else lean.split24_
                put(master[s.start : s.end], self.stream[s.start : s.end], lo)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of the tensors the engine computes with (layout.tensors), into any buffer
        laid out like this unit (host or device)."""
        return {p.name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in self.layout.tensors}

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"stream": self.stream, "grad": self.grad, **self.state}


def exact_state(numel: int, bf16: bool) -> dict[str, torch.Tensor]:
    out = {"m": torch.zeros(numel, dtype=torch.float32), "v": torch.zeros(numel, dtype=torch.float32)}
    if bf16:
        out = {"lo": torch.zeros(numel, dtype=torch.int16), **out}
    return out


def lean_state(n_exact: int, n_lean: int, kinds: tuple[bool, bool] | None = None) -> dict[str, torch.Tensor]:
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


def stream_dtype(dtype: torch.dtype, memory: str) -> torch.dtype:
    """The streaming copy's dtype for a compute dtype: lean keeps a bf16 weight whatever it
    computes in; exact streams the compute dtype (in fp32, the master itself)."""
    return torch.bfloat16 if memory == "lean" else dtype


class HostState:
    def __init__(
        self,
        store: Store,
        dtype: torch.dtype,
        alloc: Callable[[int, torch.dtype], torch.Tensor],
        progress: Callable[[int], None] = lambda n: None,
        grad_dtype: torch.dtype = torch.float32,
        memory: str = "exact",
        shard: tuple[int, int] = (1, 0),
    ):
        """dtype: the compute dtype; the streaming copy's is `stream_dtype(dtype, memory)`.
        shard: (world, rank) of a sharded run: this rank's part of every unit (module doc)."""
        dtype = stream_dtype(dtype, memory)  # self.dtype: the streaming copy's
        self.dtype, self.grad_dtype, self.memory = dtype, grad_dtype, memory
        self.world, self.rank = shard
        self.units: dict[str, UnitState] = {}
        for u in store.units:
            lay = store.layout(u.name)
            self.units[u.name] = self._load_unit(store, lay, alloc)
            progress(u.nbytes)

    def _load_unit(self, store: Store, lay: UnitLayout, alloc) -> UnitState:
        n = lay.numel
        a, b = shard_range(n, self.world, self.rank, SHARD_ALIGN)
        whole = segments(lay, self.memory)
        segs, kinds = clip_segments(whole, a, b, self.memory)
        totals = {k: kind_numel(whole, k) for k in ("exact", "lean")}
        if self.memory == "exact":
            state = exact_state(b - a, self.dtype == torch.bfloat16)
        else:
            (elo, ehi), (llo, lhi) = kinds["exact"], kinds["lean"]
            state = lean_state(ehi - elo, lhi - llo, (totals["exact"] > 0, totals["lean"] > 0))
        grad = alloc(b - a, torch.float32 if lay.name == "embed" else self.grad_dtype)  # pinned on CUDA
        grad.zero_()
        st = UnitState(lay.name, lay, self.memory, alloc(b - a, self.dtype), grad, segs, state, a)
        st.ranges = {
            k: r for k, r in buffer_ranges(self.memory, n, a, b, totals, kinds).items() if k in st.buffers()
        }
        if self.world == 1:
            src = st.stream if store.dtype == self.dtype else torch.empty(n, dtype=store.dtype)
            store.read_unit(lay.name, src)  # e.g. a bf16 store: the master is exactly it, lo = 0
        else:  # this rank's part only (dist.checkpoint verifies the checksums, split over ranks)
            src = store.unit_view(lay.name)[a:b]
        if src is not st.stream:
            if store.dtype == self.dtype:
                st.stream.copy_(src)
            else:
                st.set_master(src.to(torch.float32))
        return st

    def __getitem__(self, unit: str) -> UnitState:
        return self.units[unit]

    def nbytes(self) -> dict[str, int]:
        """Bytes by category, for the memory report."""
        out: dict[str, int] = {}
        for st in self.units.values():
            for k, t in st.buffers().items():
                out[k] = out.get(k, 0) + t.numel() * t.element_size()
        return out
