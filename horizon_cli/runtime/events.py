"""Ordering primitives of the pipeline: events, promises, and the poison that cancels them.

Every thread of the pipeline orders its work by waiting on events: the main thread (which issues
the compute), one copy worker per link direction, and the CPU optimizer's worker. An event stands
for work that has been issued and will complete on its own (a copy, an update). A `Promise` stands
for work that the main thread has yet to issue, e.g. the copy that saves layer i's input to the host,
which the backward load of layer i waits on. If the main thread raises before issuing it (a CUDA
out-of-memory on a first run is the likely case), a worker waiting on that promise would wait for
ever, and so would `Engine.close()` behind it. So every promise is created through a `Poison`,
and an error poisons them: each pending promise fails, every wait on it raises `Aborted`, the
workers drain their queues, and close returns. Work whose inputs exist (a queued AdamW update
of a complete gradient) still completes, so the host state stays at a step boundary.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future


class Aborted(RuntimeError):
    """A wait on work that will never be issued, because the engine stopped at an error."""


class Event:
    """Completion of some work. `host_wait` blocks the calling thread until it is complete."""

    def host_wait(self) -> None:
        pass

    def done(self) -> bool:
        return True


READY = Event()


class Failed(Event):
    """Work that will never happen: waiting on it raises."""

    def __init__(self, error: BaseException):
        self.error = error

    def host_wait(self) -> None:
        raise Aborted(f"pipeline stopped: {self.error!r}") from self.error


class FutureEvent(Event):
    """Work queued on a worker thread (a copy on the CPU transport, an AdamW update)."""

    def __init__(self, fut: Future):
        self.fut = fut

    def host_wait(self) -> None:
        self.fut.result()

    def done(self) -> bool:
        return self.fut.done()


class Promise(Event):
    """An event known later: `set` it once the work it stands for has been issued, or `fail` it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = threading.Event()
        self.ev: Event = READY

    def set(self, ev: Event) -> None:
        with self._lock:
            if not self._set.is_set():  # a promise failed by the poison stays failed
                self.ev = ev
                self._set.set()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if not self._set.is_set():
                self.ev = Failed(error)
                self._set.set()

    def is_set(self) -> bool:
        return self._set.is_set()

    def resolve(self) -> Event:
        self._set.wait()
        return self.ev

    def host_wait(self) -> None:
        self.resolve().host_wait()

    def done(self) -> bool:
        return self._set.is_set() and self.ev.done()


class Poison:
    """One per engine: hands out its promises, and on the first error fails every pending one
    (and every one asked for afterwards)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[Promise] = []
        self.error: BaseException | None = None

    def promises(self, n: int) -> list[Promise]:
        out = [Promise() for _ in range(n)]
        with self._lock:
            if self.error is not None:
                for p in out:
                    p.fail(self.error)
                return out
            self._pending = [p for p in self._pending if not p.is_set()] + out
        return out

    def poison(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            pending, self._pending = self._pending, []
        for p in pending:
            p.fail(error)
