"""The CUDA transport: copy streams, CUDA events, page-locked host memory.

Compute runs on the current stream of the main thread. Weight (and saved-activation) copies go
host -> device on one stream, gradients device -> host on another; each copy is issued by a
worker thread, which first makes its stream wait for the copy's dependencies: GPU-side ones
(the compute that last used a buffer) as stream waits, host-side ones (the CPU optimizer's
update of that unit) by blocking the worker, never the main thread. The hot path has no
`synchronize()` and no `.item()`.

Host memory the link reads or writes (the streaming weights, gradients, saved activations) is
allocated as ordinary memory and then page-locked in place with cudaHostRegister, so pinning
costs no second copy and no rounding: torch's pinned allocator rounds every block up to a power
of two, which would waste up to half of a terabyte-scale store.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .trace import Tracer
from .transport import DeviceMemory, Event, LinkStats, Pairs, Promise


class CudaEvent(Event):
    """A torch.cuda.Event, possibly still to be recorded by an issuing thread."""

    def __init__(self, fut: Future):
        self.fut = fut

    @staticmethod
    def now(stream: torch.cuda.Stream) -> CudaEvent:
        ev = torch.cuda.Event()
        ev.record(stream)
        fut: Future = Future()
        fut.set_result(ev)
        return CudaEvent(fut)

    def cuda(self) -> torch.cuda.Event:
        return self.fut.result()

    def host_wait(self) -> None:
        self.cuda().synchronize()

    def done(self) -> bool:
        return self.fut.done() and self.cuda().query()


class CudaTransport:
    kind = "cuda"
    shares_host = False

    def __init__(self, device: torch.device, tracer: Tracer | None = None):
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        self.device = device
        self.stats = LinkStats()
        self.memory = DeviceMemory()  # categories are still tracked for the report
        self.tracer = tracer or Tracer(enabled=False)
        self.streams = {"h2d": torch.cuda.Stream(device), "d2h": torch.cuda.Stream(device)}
        self._pools = {d: ThreadPoolExecutor(1, thread_name_prefix=f"horizon-{d}") for d in self.streams}
        self._registered: list[torch.Tensor] = []
        self._timed: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event, dict]] = []
        self._base: tuple[torch.cuda.Event, float] | None = None

    # -- memory -------------------------------------------------------------------------------
    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        if t.numel():
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(err) != 0:  # fall back to torch's pinned allocator
                return torch.empty(numel, dtype=dtype, pin_memory=True)
            self._registered.append(t)
        return t

    def host_release(self, t: torch.Tensor) -> None:
        """Unpin a buffer from host_empty before it is dropped."""
        for i, r in enumerate(self._registered):
            if r is t:
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
                del self._registered[i]
                return

    def device_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def device_peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    # -- copies -------------------------------------------------------------------------------
    def h2d(self, pairs: Pairs, deps: Sequence[Event] = (), label: str = "") -> Event:
        return self._copy("h2d", list(pairs), list(deps), label)

    def d2h(self, pairs: Pairs, deps: Sequence[Event] = (), label: str = "") -> Event:
        return self._copy("d2h", list(pairs), list(deps), label)

    def _copy(self, direction: str, pairs: list, deps: list, label: str) -> Event:
        stream = self.streams[direction]

        def job() -> torch.cuda.Event:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                for d in deps:
                    self._stream_wait(stream, d)
                start = torch.cuda.Event(enable_timing=self.tracer.enabled)
                end = torch.cuda.Event(enable_timing=self.tracer.enabled)
                start.record(stream)
                n = 0
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                    for t in (dst, src):  # the allocator must not reuse it before this stream is done
                        if t.is_cuda:
                            t.record_stream(stream)
                    n += src.numel() * src.element_size()
                end.record(stream)
            self.stats.add(direction, n)
            if self.tracer.enabled:
                self._timed.append((direction, label, start, end, {"bytes": n}))
            return end

        return CudaEvent(self._pools[direction].submit(job))

    def _stream_wait(self, stream: torch.cuda.Stream, ev: Event) -> None:
        if isinstance(ev, Promise):
            ev = ev.resolve()
        if isinstance(ev, CudaEvent):
            stream.wait_event(ev.cuda())
        else:  # a host-side dependency, e.g. the CPU optimizer's update of this unit
            ev.host_wait()

    # -- ordering -----------------------------------------------------------------------------
    def record(self) -> Event:
        return CudaEvent.now(torch.cuda.current_stream(self.device))

    def wait(self, ev: Event) -> None:
        self._stream_wait(torch.cuda.current_stream(self.device), ev)

    def synchronize(self) -> None:
        for pool in self._pools.values():
            pool.submit(lambda: None).result()
        torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def compute_span(self, name: str, **args) -> Iterator[None]:
        if not self.tracer.enabled:
            yield
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        self._timed.append(("compute", name, start, end, args))

    def mark(self) -> None:
        """Anchor GPU timestamps to the host clock (profiling only: synchronizes once)."""
        if not self.tracer.enabled:
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        ev.synchronize()
        self._base = (ev, time.perf_counter())

    def flush_trace(self) -> None:
        """Turn recorded CUDA event pairs into tracer spans on the host clock."""
        if not self._timed or self._base is None:
            return
        self.synchronize()
        base, t0 = self._base
        for lane, name, a, b, args in self._timed:
            self.tracer.add(
                lane, name, t0 + base.elapsed_time(a) / 1e3, t0 + base.elapsed_time(b) / 1e3, **args
            )
        self._timed.clear()

    def close(self) -> None:
        self.synchronize()
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        for t in self._registered:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self._registered.clear()


__all__ = ["CudaEvent", "CudaTransport"]
