"""A stand-in for CUDA on the CPU, to test the CUDA transport's own logic (engine/cuda.py).

`FakeCuda` has the interface of engine.cuda.TorchCuda. Device tensors are CPU tensors and copies
happen at once, so the numbers come out as on the CPU transport; what the fake checks is what a
CPU run cannot show. Each problem is appended to `fake.problems` (a test asserts it stays empty):

* stream order — inside `fake.watching()`, every op that touches device memory is attributed to
  the stream its thread issues on (compute on the main thread; a copy stream inside `use_stream`),
  and vector clocks built from event records, stream waits and host synchronisation say whether
  it is ordered after every earlier conflicting access from another stream, as CUDA requires.
  Copy streams are checked on host buffers too (a reload must follow the copy that saved it). A
  fresh allocation counts as a write on the allocating stream at that point: the caching
  allocator hands a block freed on a stream to the next allocation on that stream at once, while
  work queued there earlier may still use it;
* the current device of every thread that calls into CUDA (it must be the transport's);
* the per-thread last error: a failed host registration sets it, and an op on device memory
  while it is set is where torch would raise (it checks cudaGetLastError after every launch);
* host registration: overlapping or repeated registrations fail as CUDA's do (error 712), and
  unregistering what is not registered fails (713).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ALREADY_REGISTERED, NOT_REGISTERED = 712, 713
PAGE = 4096


def _join(a: dict, b: dict | None) -> None:
    for k, v in (b or {}).items():
        if a.get(k, 0) < v:
            a[k] = v


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(v) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return []


class FakeStream:
    def __init__(self, fake: FakeCuda, name: str):
        self.fake, self.name = fake, name
        self.vc: dict[str, int] = {name: 0}

    def wait_event(self, ev: FakeEvent) -> None:
        self.fake.check_device("Stream.wait_event")
        with self.fake.lock:
            self.fake.issue(self)
            _join(self.vc, ev.vc)  # never recorded: a no-op, as in CUDA


class FakeEvent:
    def __init__(self, fake: FakeCuda):
        self.fake = fake
        self.vc: dict[str, int] | None = None
        self.t = 0.0

    def record(self, stream: FakeStream | None = None) -> None:
        self.fake.check_device("Event.record")
        stream = stream or self.fake.current_stream()
        with self.fake.lock:
            self.fake.issue(stream)
            self.vc, self.t = dict(stream.vc), time.perf_counter()

    def synchronize(self) -> None:
        self.fake.check_device("Event.synchronize")
        self.fake.host_waits[threading.current_thread().name] += 1
        _join(self.fake.local_clock(), self.vc)  # the host now knows this work is complete

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.t - self.t) * 1e3


class Watch(TorchDispatchMode):
    """Sees every op of the thread it is entered on, and reports it to the fake."""

    def __init__(self, fake: FakeCuda):
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view:  # views read nothing
            self.fake.on_op(func, args, kwargs, out)
        return out


class FakeCuda:
    def __init__(self, index: int = 1, can_clear: bool = True, fail_register=lambda nbytes: False):
        self.index = index
        self.device = torch.device("cpu")  # where "device" tensors live
        self.can_clear = can_clear
        self.fail_register = fail_register  # nbytes -> True: the registration fails
        self.lock = threading.RLock()
        self.local = threading.local()
        self.problems: list[str] = []
        self.compute = FakeStream(self, "compute")
        self.streams = [self.compute]
        self.device_keys: set[int] = set()
        self.hist: dict[int, dict] = {}  # storage -> {"w": (stream, pos) | None, "r": {stream: pos}}
        self.registered: dict[int, int] = {}  # ptr -> bytes
        self.registrations = 0
        self.unregistered: Counter[int] = Counter()
        self.pinned = 0
        self.host_waits: Counter[str] = Counter()  # thread name -> Event.synchronize calls
        self.watch = False
        self.free_bytes, self.total_bytes = 80 << 30, 80 << 30
        self.allocator_configured = False

    # -- bookkeeping --------------------------------------------------------------------------
    def problem(self, what: str) -> None:
        with self.lock:
            self.problems.append(what)

    def check_device(self, call: str) -> None:
        dev = getattr(self.local, "device", 0)
        if dev != self.index:
            self.problem(f"{call} on thread {threading.current_thread().name} with current device {dev}")

    def local_clock(self) -> dict:
        if not hasattr(self.local, "clock"):
            self.local.clock = {}
        return self.local.clock

    def current_stream(self) -> FakeStream:
        return getattr(self.local, "stream", self.compute)

    def issue(self, stream: FakeStream) -> None:
        """Work issued now on `stream` runs after whatever this thread knows to be complete."""
        _join(stream.vc, self.local_clock())

    def on_op(self, func, args, kwargs, out) -> None:
        acc = []
        schema = func._schema
        for i, a in enumerate(schema.arguments):
            v = args[i] if i < len(args) else kwargs.get(a.name)
            write = a.alias_info is not None and a.alias_info.is_write
            acc += [(t, write) for t in _tensors(v)]
        outs = _tensors(out if isinstance(out, (list, tuple)) else [out])
        stream = self.current_stream()
        on_copy_stream = stream is not self.compute
        with self.lock:
            touches_device = any(_key(t) in self.device_keys for t, _ in acc)
            in_keys = {_key(t) for t, _ in acc}
            if not touches_device:  # a host op: it must follow the copies of its buffers
                for t, write in acc:
                    self._host_access(_key(t), write, func)
                for t in outs:  # and its fresh outputs are host memory
                    if _key(t) not in in_keys:
                        self.device_keys.discard(_key(t))
                        self.hist.pop(_key(t), None)
                return
            if func is torch.ops.aten._local_scalar_dense.default:  # .item(): syncs with compute
                _join(self.local_clock(), stream.vc)
            if getattr(self.local, "error", 0):
                self.problem(f"{func} launched with pending CUDA error {self.local.error}")
            self.check_device(str(func))
            if not on_copy_stream:  # what compute writes is device memory (a CUDA op cannot write the host)
                self.device_keys.update(_key(t) for t, write in acc if write and _key(t))
            self.issue(stream)
            stream.vc[stream.name] += 1
            pos = stream.vc[stream.name]
            for t, write in acc:
                k = _key(t)
                if k and (k in self.device_keys or on_copy_stream):
                    self._access(k, stream, pos, write, func)
            for t in outs:
                if _key(t) and _key(t) not in in_keys:
                    self._alloc(_key(t), stream, pos)

    def _access(self, k: int, s: FakeStream, pos: int, write: bool, func) -> None:
        h = self.hist.setdefault(k, {"w": None, "r": {}})
        w = h["w"]
        if w and w[0] != s.name and s.vc.get(w[0], 0) < w[1]:
            self.problem(
                f"{func} on {s.name} {'writes' if write else 'reads'} {k:#x} written by {w[0]} unordered"
            )
        if write:
            for rs, rp in h["r"].items():
                if rs != s.name and s.vc.get(rs, 0) < rp:
                    self.problem(f"{func} on {s.name} writes {k:#x} while {rs} may still read it")
            h["w"], h["r"] = (s.name, pos), {}
        else:
            h["r"][s.name] = max(pos, h["r"].get(s.name, 0))

    def _host_access(self, k: int, write: bool, func) -> None:
        h, clock = self.hist.get(k), self.local_clock()
        if h is None:
            return
        w = h["w"]
        if w and clock.get(w[0], 0) < w[1]:
            self.problem(f"host {func} uses {k:#x} before {w[0]}'s write to it is known complete")
        for rs, rp in h["r"].items() if write else ():
            if clock.get(rs, 0) < rp:
                self.problem(f"host {func} writes {k:#x} while {rs} may still read it")

    def _alloc(self, k: int, s: FakeStream, pos: int) -> None:
        self.device_keys.add(k)
        self.hist[k] = {"w": (s.name, pos), "r": {}}

    def _host_buffer(self, t: torch.Tensor) -> None:
        with self.lock:
            self.device_keys.discard(_key(t))
            self.hist.pop(_key(t), None)

    @contextlib.contextmanager
    def watching(self):
        """Check stream order for the ops of this thread (and of the copy streams) meanwhile."""
        self.watch = True
        try:
            with Watch(self):
                yield
        finally:
            self.watch = False

    # -- the TorchCuda interface --------------------------------------------------------------
    def set_device(self) -> None:
        self.local.device = self.index

    def new_stream(self) -> FakeStream:
        self.check_device("Stream")
        s = FakeStream(self, f"side{len(self.streams)}")
        self.streams.append(s)
        return s

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream):
        self.check_device("stream()")
        prev = self.current_stream()
        self.local.stream = stream
        try:
            with Watch(self) if self.watch else contextlib.nullcontext():
                yield
        finally:
            self.local.stream = prev

    def event(self, timing: bool = False) -> FakeEvent:
        self.check_device("Event")
        return FakeEvent(self)

    def synchronize(self) -> None:
        self.check_device("synchronize")
        with self.lock:
            for s in self.streams:
                _join(self.local_clock(), s.vc)

    def configure_allocator(self) -> None:
        self.allocator_configured = True

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        self.check_device("empty")
        t = torch.empty(shape, dtype=dtype)
        s = self.current_stream()
        with self.lock:
            self.issue(s)
            self._alloc(_key(t), s, s.vc[s.name])
        return t

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        self.check_device("record_stream")

    def max_memory_allocated(self) -> int:
        self.check_device("max_memory_allocated")
        return 0

    def reset_peak(self) -> None:
        self.check_device("reset_peak_memory_stats")

    def mem_get_info(self) -> tuple[int, int]:
        self.check_device("mem_get_info")
        return self.free_bytes, self.total_bytes

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.check_device("pinned empty")
        self.pinned += 1
        t = torch.empty(numel, dtype=dtype)
        self._host_buffer(t)
        return t

    def host_register(self, ptr: int, nbytes: int) -> int:
        self.check_device("cudaHostRegister")
        lo, hi = ptr // PAGE, (ptr + nbytes - 1) // PAGE
        clash = any(p // PAGE <= hi and lo <= (p + n - 1) // PAGE for p, n in self.registered.items())
        if clash or self.fail_register(nbytes):
            self.local.error = ALREADY_REGISTERED
            return ALREADY_REGISTERED
        self.registered[ptr] = nbytes
        self.registrations += 1
        with self.lock:
            self.device_keys.discard(ptr)
            self.hist.pop(ptr, None)
        return 0

    def host_unregister(self, ptr: int) -> int:
        self.check_device("cudaHostUnregister")
        self.unregistered[ptr] += 1
        if self.registered.pop(ptr, None) is None:
            self.local.error = NOT_REGISTERED
            return NOT_REGISTERED
        return 0

    def can_clear_errors(self) -> bool:
        return self.can_clear

    def last_error(self, clear: bool) -> int:
        self.check_device("cudaGetLastError")
        err = getattr(self.local, "error", 0)
        if clear:
            self.local.error = 0
        return err

    def error_string(self, code: int) -> str:
        return f"fake CUDA error {code}"
