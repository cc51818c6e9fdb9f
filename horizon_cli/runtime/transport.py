"""Host <-> device transport: asynchronous copies ordered by events (the CPU implementation).

The schedule talks to a transport only through this interface, so the same schedule runs on
CUDA (runtime.cuda: copy streams and CUDA events) and on the CPU, where "device" tensors are
ordinary tensors, copies run on one worker thread per direction (a duplex link) and can be
throttled to `link_gbps` to emulate PCIe. Compute runs on the calling thread, so on the CPU a
compute event is complete as soon as it is recorded.

The contract every transport keeps (docs/engine.md, "Ordering"):
  * `h2d`/`d2h` return an event; the copy starts after every event in `deps` and after all
    compute issued before the call (so a copy never touches a device buffer that compute issued
    earlier still reads or writes, freshly allocated buffers included);
  * `wait(ev)` orders the compute issued afterwards behind `ev`, `record()` marks the compute
    issued so far;
  * `thread_init` runs first in every thread that waits on the transport's events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np
import torch

from .events import READY, Event, FutureEvent
from .trace import Tracer

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (dst, src)


class Transport(Protocol):
    """What the engine's parts ask of a device (CpuTransport here, runtime.cuda.CudaTransport)."""

    kind: str  # "cpu" or "cuda"
    device: torch.device
    shares_host: bool  # "device" tensors are host memory: loads may lend host buffers
    stats: LinkStats
    memory: DeviceMemory

    def thread_init(self) -> None: ...
    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...
    def host_release(self, t: torch.Tensor) -> None: ...
    def device_empty(self, shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...
    def device_peak_bytes(self) -> int: ...
    def reset_peak(self) -> None: ...
    def h2d(self, pairs: Pairs, deps: Sequence[Event] = (), label: str = "") -> Event: ...
    def d2h(self, pairs: Pairs, deps: Sequence[Event] = (), label: str = "") -> Event: ...
    def record(self) -> Event: ...
    def wait(self, ev: Event) -> None: ...
    def compute_span(self, name: str, **args: object) -> AbstractContextManager[object]: ...
    def mark(self) -> None: ...
    def flush_trace(self) -> None: ...
    def synchronize(self) -> None: ...
    def close(self) -> None: ...


class LinkStats:
    """Bytes moved per direction; `reset` at each step. Thread safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def add(self, direction: str, n: int) -> None:
        with self._lock:
            setattr(self, direction + "_bytes", getattr(self, direction + "_bytes") + n)

    def reset(self) -> None:
        with self._lock:
            self.h2d_bytes = self.d2h_bytes = 0


class DeviceMemory:
    """The engine's own accounting of device allocations, by category (used on the CPU, where
    there is no device allocator to ask): current bytes per category and the peak of their sum."""

    def __init__(self) -> None:
        self.current: dict[str, int] = {}
        self.peak = 0

    def set(self, category: str, nbytes: int) -> None:
        self.current[category] = nbytes
        self.peak = max(self.peak, sum(self.current.values()))

    def reset_peak(self) -> None:
        self.peak = sum(self.current.values())


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> int:
    """A single-threaded memcpy (numpy releases the GIL). `Tensor.copy_` would fan out over
    torch's OpenMP pool from this worker thread, and the two thread teams then spin against the
    compute on the main thread."""
    a, b = dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy()
    np.copyto(a, b)
    return b.nbytes


class CpuTransport:
    kind = "cpu"
    shares_host: bool

    def __init__(self, link_gbps: float = 0.0, tracer: Tracer | None = None):
        self.device = torch.device("cpu")
        self.link_bps = link_gbps * 1e9
        # Without a link to emulate, "device" and host are the same memory: the loader then lends
        # the host buffers instead of copying them (copies on a worker thread would only steal
        # cores from the compute). The schedule, its events and their order stay the same.
        self.shares_host = self.link_bps == 0
        self.stats = LinkStats()
        self.memory = DeviceMemory()
        self.tracer = tracer or Tracer(enabled=False)
        self._pools = {d: ThreadPoolExecutor(1, thread_name_prefix=f"horizon-{d}") for d in ("h2d", "d2h")}

    def thread_init(self) -> None:
        """Per-thread set-up for threads that wait on this transport's events (none on the CPU)."""

    # -- memory -------------------------------------------------------------------------------
    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def host_release(self, t: torch.Tensor) -> None:
        pass

    def device_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def device_peak_bytes(self) -> int:
        return self.memory.peak

    def reset_peak(self) -> None:
        self.memory.reset_peak()

    # -- copies -------------------------------------------------------------------------------
    def h2d(self, pairs: Pairs, deps: Sequence[Event] = (), label: str = "") -> Event:
        return self._copy("h2d", pairs, deps, label)

    def d2h(self, pairs: Pairs, deps: Sequence[Event] = (), label: str = "") -> Event:
        return self._copy("d2h", pairs, deps, label)

    def _copy(self, direction: str, pairs: Pairs, deps: Sequence[Event], label: str) -> Event:
        pairs = list(pairs)

        def job() -> None:
            for d in deps:
                d.host_wait()
            t0 = time.perf_counter()
            n = 0
            for dst, src in pairs:
                n += copy_bytes(dst, src)
            if self.link_bps:  # emulate the link: the copy takes at least n / bandwidth
                rest = n / self.link_bps - (time.perf_counter() - t0)
                if rest > 0:
                    time.sleep(rest)
            self.stats.add(direction, n)
            self.tracer.add(direction, label, t0, time.perf_counter(), bytes=n)

        return FutureEvent(self._pools[direction].submit(job))

    # -- ordering -----------------------------------------------------------------------------
    def record(self) -> Event:
        """An event marking all compute issued so far (complete at once on the CPU)."""
        return READY

    def wait(self, ev: Event) -> None:
        """Make subsequent compute wait for `ev` (on the CPU: block until it is complete)."""
        ev.host_wait()

    def compute_span(self, name: str, **args):
        """Context manager timing a stretch of compute for the trace."""
        return self.tracer.span("compute", name, **args)

    def mark(self) -> None:
        pass

    def flush_trace(self) -> None:
        pass

    def synchronize(self) -> None:
        for pool in self._pools.values():
            pool.submit(lambda: None).result()

    def close(self) -> None:
        """Wait for the copies in flight and stop the workers. After an error the engine has
        poisoned its promises first, so queued copies fail fast instead of waiting for ever."""
        for pool in self._pools.values():
            pool.shutdown(wait=True)
