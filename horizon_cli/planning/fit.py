"""The device fit check: before anything is loaded, the device plan against the device's free memory.

An oversized micro-batch would otherwise fail as an out-of-memory error in the middle of the
first step, after minutes of loading. On CUDA the plan's device bytes (planning/memory.py) are
compared with what `cudaMemGetInfo` reports free, less a reserve for what the plan does not
count (cuBLAS workspaces, kernels' scratch, allocator rounding). On the CPU the device's buffers
are host RAM, and the host check (train/run.py `fits`) already counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.schema import EngineConfig
from ..errors import InputError
from ..runtime.device import cuda_index, resolve_device
from .memory import MemoryPlan

RESERVE = 1 << 30  # bytes kept free for CUDA's own use


@dataclass(frozen=True)
class Machine:
    """What a plan is judged against: host bytes a run may allocate, and the CUDA device's free
    bytes (None: the device is the CPU, its buffers are host RAM too)."""

    host: int
    device: int | None
    what: str


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def device_fit(plan: MemoryPlan, ecfg: EngineConfig) -> tuple[bool, str] | None:
    """(fits, why) on CUDA; None on the CPU."""
    dev = resolve_device(ecfg)
    if not dev.startswith("cuda"):
        return None
    index = cuda_index(dev)
    free, total = torch.cuda.mem_get_info(index)
    need = plan.device_total
    top = sorted(plan.device.items(), key=lambda kv: -kv[1])[:3]
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in top)
    why = (
        f"cuda:{index} needs {_gib(need)} ({parts}, ...) plus {_gib(RESERVE)} for CUDA's own use; "
        f"{_gib(free)} of {_gib(total)} are free"
    )
    return need + RESERVE <= free, why


def check_device_fit(plan: MemoryPlan, ecfg: EngineConfig) -> None:
    """Refuse (exit 2) a run whose device plan does not fit the device's free memory."""
    fit = device_fit(plan, ecfg)
    if fit is not None and not fit[0]:
        kept = (
            f", engine.keep_activations ({plan.kept} kept layers: {_gib(plan.kept_bytes)})"
            if plan.kept
            else ""
        )
        raise InputError(
            f"device memory plan does not fit: {fit[1]}; lower train.micro_batch_size, data.max_seq_len{kept} "
            "or engine.prefetch (see `horizon train CONFIG --dry-run`)"
        )
