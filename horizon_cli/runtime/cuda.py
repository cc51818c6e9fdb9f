"""The CUDA transport: copy streams, CUDA events, page-locked host memory.

Compute runs on the current stream of the main thread. Weight (and saved-activation) copies go
host -> device on one stream, gradients device -> host on another; each copy is issued by a
worker thread, which first makes its stream wait for the copy's dependencies: GPU-side ones
(the compute that last used a buffer) as stream waits, host-side ones (the CPU optimizer's
update of that unit) by blocking the worker, never the main thread. Every copy also waits for the
compute stream as it was when the copy was requested, so it can never write a buffer that compute
issued earlier still reads, nor one the caching allocator handed out again after such compute. The
hot path has no `synchronize()` and no `.item()`. docs/engine.md draws the streams and events.

Host memory the link reads or writes (the streaming weights, gradients, saved activations) is
allocated in pages of its own and page-locked in place with cudaHostRegister, so pinning costs
no second copy and no rounding: torch's pinned allocator rounds every block up to a power of two,
which would waste up to half of a terabyte-scale store. A registration that fails falls back to
torch's pinned allocator, after clearing the error cudaHostRegister leaves as the thread's "last
error" (torch checks that after every kernel launch and would report it there). Every registered
buffer is unregistered exactly once, and the result is checked.

All CUDA calls go through `TorchCuda`, so tests can stand in a fake (tests/support/fake_cuda.py) that
checks stream ordering, the current device of every thread and the error state on the CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..errors import HorizonError
from .events import Event, Promise
from .trace import Tracer
from .transport import DeviceMemory, LinkStats, Pairs


def _libcudart():
    """The libcudart.so torch loaded: its per-thread error state is the one torch checks."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line and ".so" in line}
    except OSError:
        return None
    for path in cudart_candidates(paths, os.path.dirname(torch.__file__), torch.version.cuda):
        with contextlib.suppress(OSError):
            return ctypes.CDLL(path)
    return None


def cudart_candidates(paths, torch_dir: str, cuda: str | None) -> list[str]:
    """The libcudart copies mapped in this process, torch's most likely first: one inside torch's
    own package (a bundled libcudart-<hash>.so), then the pip wheel torch depends on
    (site-packages/nvidia/cuda_runtime), then one whose major version is torch's CUDA's, then
    the rest. Another library may have loaded another libcudart first (an older toolkit's, a
    conda one); its error state is not the one torch checks."""
    major = f".so.{cuda.split('.')[0]}" if cuda else None
    site = os.path.dirname(torch_dir)

    def rank(path: str) -> tuple[int, str]:
        if path.startswith(torch_dir + os.sep):
            return 0, path
        if path.startswith(os.path.join(site, "nvidia") + os.sep):
            return 1, path
        if major is not None and major in path:
            return 2, path
        return 3, path

    return sorted(paths, key=rank)


class TorchCuda:
    """Everything the transport asks of CUDA: torch.cuda's streams, events, devices and memory
    statistics, and libcudart's host registration and per-thread error state."""

    def __init__(self, index: int):
        self.index = index
        self.device = torch.device("cuda", index)  # where device tensors live
        torch.cuda.set_device(index)  # creates the context, which loads libcudart
        self._rt = torch.cuda.cudart()
        lib = _libcudart()
        self._get = getattr(lib, "cudaGetLastError", None)
        self._peek = getattr(lib, "cudaPeekAtLastError", None)
        self._str = getattr(lib, "cudaGetErrorString", None)
        if self._str is not None:
            self._str.restype = ctypes.c_char_p

    # threads, streams, events
    def set_device(self) -> None:
        torch.cuda.set_device(self.index)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: torch.cuda.Stream):
        return torch.cuda.stream(stream)

    def event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    # device memory
    def configure_allocator(self) -> None:
        """Expandable segments, unless the user configured the allocator: micro-batches of varying
        length then grow and shrink segments instead of fragmenting fixed-size blocks."""
        if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
            with contextlib.suppress(Exception):  # private API; an older torch just keeps its default
                torch.cuda.memory._set_allocator_settings("expandable_segments:True")

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def record_stream(self, t: torch.Tensor, stream: torch.cuda.Stream) -> None:
        if t.is_cuda:  # the allocator must not reuse it before `stream` is done with it
            t.record_stream(stream)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.index)

    # host memory
    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def host_register(self, ptr: int, nbytes: int) -> int:
        return int(self._rt.cudaHostRegister(ptr, nbytes, 0))

    def host_unregister(self, ptr: int) -> int:
        return int(self._rt.cudaHostUnregister(ptr))

    def can_clear_errors(self) -> bool:
        return self._get is not None and self._peek is not None

    def last_error(self, clear: bool) -> int:
        """cudaGetLastError (clear) or cudaPeekAtLastError, for the calling thread."""
        fn = self._get if clear else self._peek
        return int(fn()) if fn is not None else 0

    def error_string(self, code: int) -> str:
        name = self._str(code) if self._str is not None else None
        return f"{name.decode()} (CUDA error {code})" if name else f"CUDA error {code}"


class CudaEvent(Event):
    """A CUDA event, possibly still to be recorded by an issuing thread."""

    def __init__(self, fut: Future):
        self.fut = fut

    @staticmethod
    def now(api, stream) -> CudaEvent:
        ev = api.event()
        ev.record(stream)
        fut: Future = Future()
        fut.set_result(ev)
        return CudaEvent(fut)

    def cuda(self):
        return self.fut.result()

    def host_wait(self) -> None:
        self.cuda().synchronize()

    def done(self) -> bool:
        return self.fut.done() and self.cuda().query()


def page_aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Host memory in pages of its own (an anonymous mapping, never a file's): cudaHostRegister
    pins whole pages, so two buffers sharing a page could not both be registered."""
    buf = mmap.mmap(-1, max(1, numel * dtype.itemsize))
    return torch.frombuffer(buf, dtype=dtype, count=numel)  # the tensor keeps `buf` alive


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CudaTransport:
    kind = "cuda"
    shares_host = False

    def __init__(self, device: torch.device, tracer: Tracer | None = None, api=None):
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.api = api or TorchCuda(index)
        self.api.set_device()
        self.api.configure_allocator()
        self.device = self.api.device
        self.stats = LinkStats()
        self.memory = DeviceMemory()  # categories are still tracked for the report
        self.tracer = tracer or Tracer(enabled=False)
        self.streams = {"h2d": self.api.new_stream(), "d2h": self.api.new_stream()}
        self._pools = {
            d: ThreadPoolExecutor(1, thread_name_prefix=f"horizon-{d}", initializer=self.thread_init)
            for d in self.streams
        }
        # without a way to clear a failed registration's error, never risk one: pin with torch
        self.register = self.api.can_clear_errors()
        self._registered: dict[int, torch.Tensor] = {}  # data_ptr -> buffer, each unregistered once
        self.fallbacks = 0  # buffers pinned by torch's allocator because registration failed
        self._timed: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event, dict]] = []
        self._base: tuple[torch.cuda.Event, float] | None = None

    def thread_init(self) -> None:
        """Every thread that touches CUDA makes the transport's device current first: a runtime
        call on a thread whose current device is another GPU creates a context there (or fails,
        when that GPU is in exclusive mode)."""
        self.api.set_device()

    # -- memory -------------------------------------------------------------------------------
    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        if self.register:
            t = page_aligned_empty(numel, dtype)
            err = self.api.host_register(t.data_ptr(), _nbytes(t))
            if err == 0:
                self._registered[t.data_ptr()] = t
                return t
            self._clear_error(err, "cudaHostRegister")
            self.fallbacks += 1
        return self.api.pinned_empty(numel, dtype)

    def host_release(self, t: torch.Tensor) -> None:
        """Unpin a buffer from host_empty before it is dropped (releasing it again does nothing)."""
        self._unregister(t.data_ptr())

    def _unregister(self, ptr: int) -> None:
        t = self._registered.pop(ptr, None)
        if t is None:
            return
        err = self.api.host_unregister(ptr)
        if err:
            self._clear_error(err, "cudaHostUnregister")
            raise HorizonError(
                f"cudaHostUnregister failed for a {_nbytes(t)}-byte host buffer: {self.api.error_string(err)}"
            )

    def _clear_error(self, err: int, call: str) -> None:
        """A failed runtime call leaves its error as this thread's last error; torch checks that
        after the next kernel launch and would blame the kernel. Clear it, and check it is gone."""
        self.api.last_error(clear=True)
        left = self.api.last_error(clear=False)
        if left:
            raise HorizonError(
                f"CUDA error state not clean after a failed {call} ({self.api.error_string(err)}): "
                f"{self.api.error_string(left)}"
            )

    def device_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return self.api.empty(shape, dtype)

    def device_peak_bytes(self) -> int:
        return self.api.max_memory_allocated()

    def reset_peak(self) -> None:
        self.api.reset_peak()

    # -- copies -------------------------------------------------------------------------------
    def h2d(self, pairs: Pairs, deps: Sequence[Event] = (), label: str = "") -> Event:
        return self._copy("h2d", list(pairs), [self.record(), *deps], label)

    def d2h(self, pairs: Pairs, deps: Sequence[Event] = (), label: str = "") -> Event:
        return self._copy("d2h", list(pairs), [self.record(), *deps], label)

    def _copy(self, direction: str, pairs: list, deps: list, label: str) -> Event:
        stream = self.streams[direction]
        timing = self.tracer.enabled

        def job():
            with self.api.use_stream(stream):
                for d in deps:
                    self._stream_wait(stream, d)
                start, end = self.api.event(timing), self.api.event(timing)
                start.record(stream)
                n = 0
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                    for t in (dst, src):
                        self.api.record_stream(t, stream)
                    n += _nbytes(src)
                end.record(stream)
            self.stats.add(direction, n)
            if timing:
                self._timed.append((direction, label, start, end, {"bytes": n}))
            return end

        return CudaEvent(self._pools[direction].submit(job))

    def _stream_wait(self, stream, ev: Event) -> None:
        if isinstance(ev, Promise):
            ev = ev.resolve()
        if isinstance(ev, CudaEvent):
            stream.wait_event(ev.cuda())
        else:  # a host-side dependency, e.g. the CPU optimizer's update of this unit
            ev.host_wait()

    # -- ordering -----------------------------------------------------------------------------
    def record(self) -> Event:
        return CudaEvent.now(self.api, self.api.current_stream())

    def wait(self, ev: Event) -> None:
        self._stream_wait(self.api.current_stream(), ev)

    def synchronize(self) -> None:
        for pool in self._pools.values():
            pool.submit(lambda: None).result()
        self.api.synchronize()

    @contextlib.contextmanager
    def compute_span(self, name: str, **args) -> Iterator[None]:
        if not self.tracer.enabled:
            yield
            return
        stream = self.api.current_stream()
        start, end = self.api.event(True), self.api.event(True)
        start.record(stream)
        yield
        end.record(stream)
        self._timed.append(("compute", name, start, end, args))

    def mark(self) -> None:
        """Anchor GPU timestamps to the host clock (profiling only: synchronizes once)."""
        if not self.tracer.enabled:
            return
        ev = self.api.event(True)
        ev.record(self.api.current_stream())
        ev.synchronize()
        self._base = (ev, time.perf_counter())

    def flush_trace(self) -> None:
        """Turn recorded CUDA event pairs into tracer spans on the host clock."""
        if not self._timed or self._base is None:
            return
        self.synchronize()
        base, t0 = self._base
        for lane, name, a, b, args in self._timed:
            t_a, t_b = base.elapsed_time(a) / 1e3, base.elapsed_time(b) / 1e3
            self.tracer.add(lane, name, t0 + t_a, t0 + t_b, **args)
        self._timed.clear()

    def close(self) -> None:
        """Finish the copies in flight, stop the workers, unregister every pinned buffer once."""
        try:
            self.synchronize()
        finally:
            for pool in self._pools.values():
                pool.shutdown(wait=True)
            errors = []
            for ptr in list(self._registered):
                try:
                    self._unregister(ptr)
                except HorizonError as e:
                    errors.append(e)
            if errors:
                raise errors[0]


__all__ = ["CudaEvent", "CudaTransport", "TorchCuda"]
