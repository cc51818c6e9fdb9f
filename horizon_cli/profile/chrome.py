"""Chrome / Perfetto trace (JSON "traceEvents"): one track per lane, one slice per span."""

from __future__ import annotations

import json
from pathlib import Path

from ..runtime.trace import Span

LANES = ("h2d", "compute", "d2h", "optimizer", "step")


def write_trace(spans: list[Span], path: Path) -> Path:
    if not spans:
        raise ValueError("no spans to write")
    t0 = min(s.t0 for s in spans)
    lanes = {lane: i for i, lane in enumerate(LANES)}
    events = [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": lane}}
        for lane, i in lanes.items()
    ]
    events.append({"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "horizon"}})
    for s in spans:
        tid = lanes.setdefault(s.lane, len(lanes))
        events.append(
            {
                "name": s.name,
                "cat": s.lane,
                "ph": "X",
                "pid": 0,
                "tid": tid,
                "ts": (s.t0 - t0) * 1e6,
                "dur": max(0.0, s.t1 - s.t0) * 1e6,
                "args": s.args,
            }
        )
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return Path(path)
