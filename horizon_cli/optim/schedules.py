"""Learning-rate schedules: constant, linear or cosine decay after a linear warmup.

`lr_at(step)` takes the 0-based index of the optimizer step about to run. Warmup rises linearly
over `warmup_steps` steps, reaching the peak at step `warmup_steps` (its first step already uses
lr / (warmup_steps + 1), never 0). Decay then follows transformers' schedules: progress runs from
0 at the end of warmup towards 1 at `total` (so the last step keeps a small non-zero rate),
ending near `min_lr_ratio * lr`.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, total: int, kind: str, warmup: int = 0, min_ratio: float = 0.0) -> float:
    if warmup and step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if kind == "constant":
        return lr
    frac = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    if kind == "linear":
        scale = 1.0 - frac
    elif kind == "cosine":
        scale = 0.5 * (1.0 + math.cos(math.pi * frac))
    else:
        raise ValueError(f"unknown schedule {kind!r}")
    return lr * (min_ratio + (1.0 - min_ratio) * scale)
