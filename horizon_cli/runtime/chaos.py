"""The chaos transport (`engine.link_chaos: true`): the CPU transport made as unordered as the
contract allows, so that a missing wait gives wrong numbers on the CPU.

On CUDA a copy and the compute race unless an event orders them; on the plain CPU transport
they mostly cannot (no emulated link: no copies at all; with one: one worker per direction, in
order, and the compute a copy depends on is finished when it is requested). Here:

  * every copy runs on a thread of its own, after a random (seeded) delay, so two copies in one
    direction may complete in either order and a copy lands at an unpredictable point of the
    compute that follows it; it still waits for every event in its `deps` (the contract);
  * host and device are apart (`shares_host` is False): every load is a real copy;
  * a fresh device buffer is filled with NaN (integers: a large value), so compute that reads a
    buffer before the copy into it has landed computes garbage rather than yesterday's data;
  * `host_release` of a host buffer a copy in flight still reads or writes raises (on CUDA: DMA
    into unregistered, possibly freed pages).

Only the events the engine records order anything, exactly as on CUDA (where compute issued
before a copy's request is ordered by the stream event `record()` takes; on the CPU that compute
is already done). A run under it equals a plain run bitwise when the engine's waits are complete:
tests/runtime/test_chaos.py runs the engine's schedules both ways and removes one wait to see it differ.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from ..errors import HorizonError
from .events import Event, FutureEvent
from .trace import Tracer
from .transport import CpuTransport, Pairs, copy_bytes

# Each copy starts this long after its dependencies are met: mostly a short random delay, and one
# copy in LONG_EVERY a long one (a copy that lands a few layers late, as a busy link's would).
MAX_DELAY_S = 0.002
LONG_DELAY_S = 0.03
LONG_EVERY = 4


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).max // 2 if t.dtype != torch.uint8 else 255)


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


class ChaosTransport(CpuTransport):
    kind = "cpu"

    def __init__(self, seed: int = 0, scale: float = 1.0, tracer: Tracer | None = None):
        """scale: every delay multiplied by it."""
        super().__init__(0.0, tracer=tracer)
        self.shares_host = False  # every load is a copy, as across a real link
        self.scale = scale
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._inflight: dict[Future, list[tuple[int, int]]] = {}

    # -- memory -------------------------------------------------------------------------------
    def device_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return _poison(torch.empty(shape, dtype=dtype))

    def host_release(self, t: torch.Tensor) -> None:
        """A host buffer is about to be dropped: no copy may still be reading or writing it."""
        lo, hi = _span(t)
        with self._lock:
            busy = [
                f
                for f, spans in self._inflight.items()
                if not f.done() and any(a < hi and lo < b for a, b in spans)
            ]
        if busy and hi > lo:
            raise HorizonError(
                f"host buffer of {hi - lo} bytes released while a copy still uses it (link_chaos)"
            )

    # -- copies -------------------------------------------------------------------------------
    def _copy(self, direction: str, pairs: Pairs, deps: Sequence[Event], label: str) -> Event:
        pairs, deps = list(pairs), list(deps)
        with self._lock:
            longest = LONG_DELAY_S if self._rng.randrange(LONG_EVERY) == 0 else MAX_DELAY_S
            delay = self.scale * self._rng.uniform(0.0, longest)
        fut: Future = Future()
        host = [_span(src if direction == "h2d" else dst) for dst, src in pairs]

        def job() -> None:
            try:
                for d in deps:
                    d.host_wait()
                time.sleep(delay)
                t0, n = time.perf_counter(), 0
                for dst, src in pairs:
                    n += copy_bytes(dst, src)
                self.stats.add(direction, n)
                self.tracer.add(direction, label, t0, time.perf_counter(), bytes=n)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the copy
                fut.set_exception(e)
            else:
                fut.set_result(None)
            finally:
                with self._lock:
                    self._inflight.pop(fut, None)

        with self._lock:
            self._inflight[fut] = host
        threading.Thread(target=job, name=f"horizon-chaos-{direction}", daemon=True).start()
        return FutureEvent(fut)

    # -- ordering -----------------------------------------------------------------------------
    def _pending(self) -> list[Future]:
        with self._lock:
            return list(self._inflight)

    def synchronize(self) -> None:
        while pending := self._pending():
            for f in pending:
                f.exception()  # waits; the error belongs to whoever waits on the copy's event

    def close(self) -> None:
        self.synchronize()
        super().close()
