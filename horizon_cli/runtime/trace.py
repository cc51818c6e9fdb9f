"""Timeline recording: spans on lanes (h2d, d2h, compute, optimizer) for `horizon profile`.

Disabled tracers cost one attribute check per span. Times are `time.perf_counter()` seconds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Span:
    lane: str
    name: str
    t0: float
    t1: float
    args: dict = field(default_factory=dict)


class Tracer:
    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.spans: list[Span] = []

    def add(self, lane: str, name: str, t0: float, t1: float, **args) -> None:
        if self.enabled:
            self.spans.append(Span(lane, name, t0, t1, args))  # list.append is atomic under the GIL

    @contextlib.contextmanager
    def span(self, lane: str, name: str, **args) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Span(lane, name, t0, time.perf_counter(), args))

    def clear(self) -> None:
        self.spans = []
