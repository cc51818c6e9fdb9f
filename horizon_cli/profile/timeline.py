"""Reading a trace: busy time per lane inside each step, and how well the lanes overlap.

A step's window runs from its start to the next step's start (the optimizer of step t overlaps
step t+1's forward, so this is the steady-state period). Within it:

  compute_s    device busy time (union of compute spans)
  transfer_s   link busy time: the busier direction (H2D and D2H are separate, full-duplex lanes)
  optimizer_s  CPU optimizer busy time
  overlap      max(compute_s, transfer_s) / step_s: 1.0 means the slower of compute and the link
               set the pace and nothing else was exposed
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..runtime.trace import Span


def busy(spans: list[Span], lo: float = float("-inf"), hi: float = float("inf")) -> float:
    """Length of the union of the spans' intervals, clipped to [lo, hi]."""
    iv = sorted((max(s.t0, lo), min(s.t1, hi)) for s in spans if s.t1 > lo and s.t0 < hi)
    total, end = 0.0, float("-inf")
    for a, b in iv:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass
class StepTimes:
    step_s: float
    compute_s: float
    transfer_s: float
    h2d_s: float
    d2h_s: float
    optimizer_s: float

    @property
    def overlap(self) -> float:
        return max(self.compute_s, self.transfer_s) / self.step_s if self.step_s else 0.0


def step_times(spans: list[Span]) -> list[StepTimes]:
    """One entry per step window (a window needs the next step's start, or the step's own end
    for the last one)."""
    steps = sorted((s for s in spans if s.lane == "step"), key=lambda s: s.t0)
    lanes = {k: [s for s in spans if s.lane == k] for k in ("compute", "h2d", "d2h", "optimizer")}
    out = []
    for i, st in enumerate(steps):
        hi = steps[i + 1].t0 if i + 1 < len(steps) else st.t1
        h2d, d2h = busy(lanes["h2d"], st.t0, hi), busy(lanes["d2h"], st.t0, hi)
        out.append(
            StepTimes(
                step_s=hi - st.t0,
                compute_s=busy(lanes["compute"], st.t0, hi),
                transfer_s=max(h2d, d2h),
                h2d_s=h2d,
                d2h_s=d2h,
                optimizer_s=busy(lanes["optimizer"], st.t0, hi),
            )
        )
    return out


def median_step(times: list[StepTimes]) -> StepTimes:
    if not times:
        raise ValueError("no complete step in the trace")
    fields = StepTimes.__dataclass_fields__
    return StepTimes(**{f: statistics.median(getattr(t, f) for t in times) for f in fields})
