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
                                   grad is always fp32, because the host accumulates it row by row.
                                   One rank's untied embedding table holds only the rows a step
                                   touched (`rows`, sorted; the rest are zero): a step of N tokens
                                   touches at most N of the vocabulary's rows
                                   A release mode (optim.grad_release) allocates none per unit: a
                                   unit's gradient lands in chunks of the run's few buffers
                                   (`pool`, state.pool; on several ranks its slice in one of
                                   them, its `grad` from landing to update), the embedding's
                                   aside (one rank: its own buffer)

The optimizer state comes in kinds (exact, lean), over segments of the unit, in buffers packed
per kind; which, is the memory mode's layout (`optim.memory`: optim/modes.py picks a layout of
state/layout.py).

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

from ..optim.modes import EXACT, MemoryMode, memory_mode
from ..parallel.shard import SHARD_ALIGN, shard_range
from ..store import Store, UnitLayout
from .layout import Segment, StateKind, StateLayout, kind_numel, state_layout
from .pool import ChunkPool, GradPool, empty_grad


@dataclass
class UnitState:
    name: str
    layout: UnitLayout
    scheme: StateLayout  # where its optimizer state lives: its memory mode's layout (state/layout.py)
    stream: torch.Tensor
    grad: torch.Tensor
    segments: list[Segment]
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # packed per kind, see the module doc
    start: int = 0  # sharded runs: the first element of the unit this rank holds (its `stream[0]`)
    ranges: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # buffer -> (lo, hi, length)
    # a compact gradient (one rank's untied embedding table): grad[i*H:(i+1)*H] is row rows[i]'s,
    # rows sorted; the rows not in it have a zero gradient. None: grad is laid out as the unit
    rows: torch.Tensor | None = None

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
        return self.scheme.master(self.stream, self.state, self.segments)

    def set_master(self, master: torch.Tensor) -> None:
        """Write fp32 master weights (numel,) into the stream and the state, rounded as kept."""
        if self.stream.dtype == torch.float32:
            self.stream.copy_(master)
        else:
            self.scheme.set_master(master, self.stream, self.state, self.segments)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of the tensors the engine computes with (layout.tensors), into any buffer
        laid out like this unit (host or device)."""
        return {p.name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in self.layout.tensors}

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"stream": self.stream, "grad": self.grad, **self.state}

    def grad_span(self, g: torch.Tensor, lo: int, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the unit's gradient, from `g` holding its elements from `lo` on (its
        grad buffer, or a release chunk); a compact gradient's (`rows`, lo 0) expanded: zeros
        where no row was touched."""
        if self.rows is None:
            return g[a - lo : b - lo]
        width = self.layout.tensors[0].shape[-1]
        r0, r1 = a // width, -(-b // width)
        out = torch.zeros((r1 - r0) * width, dtype=g.dtype)
        i0, i1 = torch.searchsorted(self.rows, torch.tensor([r0, r1])).tolist()
        if i1 > i0:
            got = g[i0 * width : i1 * width].view(-1, width)
            out.view(-1, width).index_copy_(0, self.rows[i0:i1] - r0, got)
        return out[a - r0 * width : b - r0 * width]

    def dense_grad(self) -> torch.Tensor:
        """The whole gradient laid out as the unit (a compact one expanded: a copy)."""
        return self.grad if self.rows is None else self.grad_span(self.grad, 0, 0, self.stream.numel())


def compact_grad(lay: UnitLayout, tied: bool, world: int) -> bool:
    """Whether the unit's host gradient is compact by rows (UnitState.rows): one rank's embedding
    when it is the table alone and untied (a tied LM head's gradient fills every row). The plan
    counts it so (planning.host_state.compact_rows)."""
    tensors = lay.tensors
    return lay.name == "embed" and world == 1 and not tied and len(tensors) == 1 and tensors[0].offset == 0


def stream_dtype(dtype: torch.dtype, mode: MemoryMode) -> torch.dtype:
    """The streaming copy's dtype for a compute dtype: lean keeps a bf16 weight whatever it
    computes in; exact streams the compute dtype (in fp32, the master itself)."""
    return torch.bfloat16 if mode.bf16_weight else dtype


class HostState:
    # a release mode's host gradient buffers (state.pool): several ranks' slices, one rank's chunks
    pool: GradPool | None = None
    chunks: ChunkPool | None = None

    def __init__(
        self,
        store: Store,
        dtype: torch.dtype,
        alloc: Callable[[int, torch.dtype], torch.Tensor],
        progress: Callable[[int], None] = lambda n: None,
        grad_dtype: torch.dtype = torch.float32,
        memory: MemoryMode | str = EXACT,
        shard: tuple[int, int] = (1, 0),
    ):
        """dtype: the compute dtype; the streaming copy's is `stream_dtype(dtype, mode)`. memory:
        the memory mode (or its word). shard: (world, rank) of a sharded run: this rank's part of
        every unit (module doc)."""
        self.mode = memory_mode(memory)
        self.scheme = state_layout(self.mode)
        self.dtype, self.grad_dtype = stream_dtype(dtype, self.mode), grad_dtype  # the streaming copy's
        self.world, self.rank = shard
        self.units: dict[str, UnitState] = {}
        for u in store.units:
            lay = store.layout(u.name)
            self.units[u.name] = self._load_unit(store, lay, alloc)
            progress(u.nbytes)
        if self.mode.release and self.world == 1:
            self.chunks = ChunkPool(self.units, alloc, self.grad_dtype)
        elif self.mode.release:
            self.pool = GradPool(self.units, alloc)

    def take(self, unit: str) -> torch.Tensor:
        """The unit's host gradient buffer for this step (release: taken from the pool)."""
        st = self.units[unit]
        return st.grad if self.pool is None else self.pool.take(st)

    def _load_unit(self, store: Store, lay: UnitLayout, alloc) -> UnitState:
        n = lay.numel
        a, b = shard_range(n, self.world, self.rank, SHARD_ALIGN)
        whole = self.scheme.segments(lay)
        segs, kinds = self.scheme.clip(whole, a, b)
        totals = {k: kind_numel(whole, k) for k in StateKind}
        state = self.scheme.alloc(b - a, self.dtype == torch.bfloat16, totals, kinds)
        gdt = torch.float32 if lay.name == "embed" else self.grad_dtype
        compact = compact_grad(lay, store.arch.tie_embeddings, self.world)
        # release: a pool buffer while needed (one rank's embedding: its own); compact: sized per step
        pooled = self.mode.release and (self.world > 1 or lay.name != "embed")
        if pooled or compact:
            grad = empty_grad(gdt)
        else:
            grad = alloc(b - a, gdt)  # pinned on CUDA
            grad.zero_()
        st = UnitState(lay.name, lay, self.scheme, alloc(b - a, self.dtype), grad, segs, state, a)
        st.rows = torch.empty(0, dtype=torch.int64) if compact else None
        ranges = self.scheme.ranges(n, a, b, totals, kinds)
        st.ranges = {k: r for k, r in ranges.items() if k in st.buffers()}
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
        pools = [p for p in (self.pool, self.chunks) if p is not None]
        out: dict[str, int] = {"grad": pools[0].nbytes()} if pools else {}
        for st in self.units.values():
            for k, t in st.buffers().items():
                out[k] = out.get(k, 0) + t.numel() * t.element_size()
        return out
