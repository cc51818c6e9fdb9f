"""The optimize stage: AdamW on the CPU, unit by unit on a worker thread, overlapped with device work.

The engine submits every unit once the step's clip coefficient is known, in the order the next
step's forward will load them (layer 0 first); each unit's completion is an event the loader
waits on before streaming that unit again. A release run (optim.grad_release) submits each unit
inside the backward as soon as its gradient is whole (`release`), gated (engine.release: a unit
whose gradient or loss is not finite is refused, and every unit after it). Units are updated in slices so the pure-torch path's
temporaries stay small. The arithmetic lives below the pipeline, in optim/ (adamw, native).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from ..optim.adamw import AdamWHyper
from ..optim.kernel import pick_kernel
from ..optim.lean import rounding_seed
from ..runtime.events import Event, FutureEvent
from ..runtime.trace import Tracer
from . import slices as sl
from .host import HostState, UnitState
from .layout import LEAN_BLOCK, Segment, StateKind


class OptimizerWorker:
    def __init__(
        self,
        host: HostState,
        kernel: str = "auto",
        tracer: Tracer | None = None,
        thread_init: Callable[[], None] = lambda: None,
    ):
        self.host = host
        self.impl, self.kernel_name, self.note = pick_kernel(kernel)
        self.tracer = tracer or Tracer(enabled=False)
        # thread_init: the transport's per-thread set-up (on CUDA: the current device, because
        # this thread waits on CUDA events)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="horizon-optim", initializer=thread_init)
        self.pending: list[Event] = []

    def submit(self, units: list[str], h: AdamWHyper, deps: dict[str, Event]) -> dict[str, Event]:
        """Queue AdamW for `units` in order; returns each unit's completion event."""
        out: dict[str, Event] = {}
        for u in units:
            fut = self.pool.submit(self._update, self.host[u], h, deps.get(u))
            out[u] = FutureEvent(fut)
        self.pending = list(out.values())
        return out

    def release(
        self,
        unit: str,
        h: AdamWHyper,
        dep: Event,
        gate: Callable[[], bool],
        applied: list[str],
        grad: torch.Tensor | None = None,
        lo: int = 0,
    ) -> Event:
        """Queue one unit's AdamW inside the backward (release: engine.release), once `dep` (its
        gradient on the host) is done and only if `gate()` then holds (its gradient finite). grad:
        the gradient of elements [lo, lo + grad.numel()) of the unit (a chunk: only the slices in
        it are updated); default the unit's grad buffer as it is now. Appends the unit to `applied`
        once its first part is updated."""
        st = self.host[unit]
        g = st.grad if grad is None else grad
        ev = FutureEvent(self.pool.submit(self._gated, st, g, lo, h, dep, gate, applied))
        self.pending = [ev]  # one worker, in order: the last one done, all are
        return ev

    def _gated(
        self,
        st: UnitState,
        g: torch.Tensor,
        lo: int,
        h: AdamWHyper,
        dep: Event,
        gate: Callable[[], bool],
        applied: list[str],
    ) -> None:
        dep.host_wait()
        if gate():
            self._update(st, h, None, g, lo)
            if not applied or applied[-1] != st.name:
                applied.append(st.name)

    def _update(
        self, st: UnitState, h: AdamWHyper, dep: Event | None, g: torch.Tensor | None = None, lo: int = 0
    ) -> None:
        """g: the gradient to read (release: its pool buffer as it was at submission; st.grad by
        default), holding elements [lo, lo + g.numel()) of the unit: the slices inside them."""
        if dep is not None:
            dep.host_wait()
        g = st.grad if g is None else g
        hi = lo + (g.numel() if st.rows is None else st.stream.numel())  # compact: by rows
        t0 = time.perf_counter()
        for seg, a, b in sl.slices(st.segments, lo, hi):  # frozen tensors (a routing bias) are in none
            self._update_slice(st, st.grad_span(g, lo, a, b), seg, a, b, h)
        self.tracer.add("optimizer", st.name, t0, time.perf_counter())

    def _update_slice(
        self, st: UnitState, g: torch.Tensor, seg: Segment, a: int, b: int, h: AdamWHyper
    ) -> None:
        """Elements [a, b) of the unit, inside one segment, their gradient `g`; k: where they sit
        in its packed state."""
        s = st.state
        if g.dtype != torch.float32 and self.kernel_name == "torch":  # the kernel reads bf16 itself
            g = g.float()
        k = seg.at + (a - seg.start)
        q = slice(k, k + b - a)
        if seg.kind == StateKind.LEAN:
            blk = slice(k // LEAN_BLOCK, (k + b - a) // LEAN_BLOCK)
            qm, qw, sm, sw = s["qm"][q], s["qw"][q], s["sm"][blk], s["sw"][blk]
            seed = rounding_seed(st.name, h.step)
            self.impl.adamw_lean_(st.stream[a:b], s["lo8"][q], g, qm, qw, sm, sw, h, seed, st.start + a)
        elif "lo" not in s:  # fp32 runs: the stream is the master
            self.impl.adamw_fp32_(st.stream[a:b], g, s["m"][q], s["v"][q], h)
        else:
            self.impl.adamw_split_(st.stream[a:b], s["lo"][q], g, s["m"][q], s["v"][q], h)

    def wait(self) -> None:
        for ev in self.pending:
            ev.host_wait()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
