"""Fused elementwise work on CUDA (issue 42): RMSNorm, RoPE's rotation and SwiGLU's
silu(gate) * up, each compiled by torch.compile (inductor: one kernel for the forward, one for the
backward, instead of one per op with fp32 temporaries between them).

Off by default: it has not been measured on a GPU, and the plan is to turn it on only where it is
measured faster. `HORIZON_FUSED=1` turns it on for CUDA tensors (scripts/gpu_check.sh's
throughput stage can time both ways). The functions compiled are model/layer.py's eager ones, as
they are; tests/model/test_fused.py checks the compiled ones against them on the CPU backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

ENV = "HORIZON_FUSED"
_compiled: dict[tuple[Callable, str], Callable] = {}


def enabled(x: torch.Tensor) -> bool:
    return x.is_cuda and os.environ.get(ENV) == "1"


def compiled(fn: Callable, backend: str = "inductor") -> Callable:
    """`fn` compiled once per process, for any shape (dynamic)."""
    key = (fn, backend)
    got = _compiled.get(key)
    if got is None:
        got = _compiled[key] = torch.compile(fn, dynamic=True, backend=backend)
    return got
