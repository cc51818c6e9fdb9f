"""Learning-rate schedules: constant, linear or cosine decay after a linear warmup.

`lr_at(step)` takes the 0-based index of the optimizer step about to run; warmup reaches the
peak at step `warmup_steps`; decay ends at `min_lr_ratio * lr` on the last step.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, total: int, kind: str, warmup: int = 0, min_ratio: float = 0.0) -> float:
    if warmup and step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if kind == "constant":
        return lr
    span = max(1, total - 1 - warmup)
    frac = min(1.0, max(0.0, (step - warmup) / span))
    if kind == "linear":
        scale = 1.0 - frac
    elif kind == "cosine":
        scale = 0.5 * (1.0 + math.cos(math.pi * frac))
    else:
        raise ValueError(f"unknown schedule {kind!r}")
    return lr * (min_ratio + (1.0 - min_ratio) * scale)
