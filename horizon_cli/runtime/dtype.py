"""The compute dtype: `engine.dtype` resolved once, before planning, for the device the run uses.

`auto` computes in bf16 only where the device multiplies bf16 matrices fast, otherwise in fp32:

  CUDA   compute capability 8.0 or newer (Ampere on): native bf16 tensor cores. A dry run on a
         machine without CUDA plans for such a GPU (an H200 planned from a laptop is not Volta)
  CPU    AVX-512 BF16 or AMX (Cooper Lake, Sapphire Rapids on; AMD Zen 4 on). Without them torch's
         bf16 matrix product falls back to a scalar kernel: on an AVX2-only CPU a 512x576 @ 576x1536
         product takes 1,427 ms in bf16 against 50 ms in fp32 (torch 2.13, issue 32)

What the store holds is not changed (a bf16 store computing in fp32 is upcast: where there is a
link, on the device, so that the stored bytes are what crosses it; state.widen). `optim.memory:
lean` decides alike: its bf16 weight is a storage format, upcast per layer when computing in
fp32. The choice is made once, at the start, and the run records the concrete dtype (its
config.yaml, trainer.json), so a resume compares what was computed with, not the word `auto`. An explicit `bfloat16` where it is
slow runs as asked, after one warning line (`note`).

What the CPU can do is read from torch's cpuinfo (`torch.cpu.get_capabilities()`), else from
/proc/cpuinfo's flags (Linux); `torch.backends.cpu.get_cpu_capability()` does not say it (it names
the vector width ATen's kernels were built for: "AVX512" on a CPU with AMX as on one without).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config.schema import Config, EngineConfig
from ..optim.modes import EXACT, MemoryMode, memory_mode
from .device import resolve_device

CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # either: bf16 matrix products in hardware
# 1: take this CPU as multiplying bf16 fast, 0: as not — detection overridden (a CPU torch's cpuinfo
# misreads; the test suite, so that what `auto` means there does not depend on the machine)
FORCE = "HORIZON_CPU_BF16"
SLOWER = "~30x"  # bf16 against fp32 matrix products without them (issue 32: 1,427 ms against 50 ms)


def cpu_bf16_flags() -> list[str]:
    """The CPU's bf16 matrix features (of CPU_FLAGS) this machine has; [] when it has none."""
    forced = os.environ.get(FORCE, "")
    if forced in ("0", "1"):
        return [f"{FORCE}=1"] if forced == "1" else []
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        try:
            got = caps()
            return [f for f in CPU_FLAGS if got.get(f)]
        except (RuntimeError, AttributeError):  # an old or odd build: fall back to the kernel's list
            pass
    return [f for f in CPU_FLAGS if f in proc_cpuinfo_flags()]


def proc_cpuinfo_flags(path: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The flags /proc/cpuinfo lists for the first CPU (empty where there is no such file)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cuda_bf16(device: str) -> bool:
    """Whether the CUDA device computes bf16 natively (compute capability 8.0 or newer); False for
    a device this machine lacks (runtime.device.check_device refuses it, in one line)."""
    if not torch.cuda.is_available():
        return False
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index >= torch.cuda.device_count():
        return False
    major, _ = torch.cuda.get_device_capability(index)
    return major >= 8


@dataclass(frozen=True)
class DtypeChoice:
    given: str  # the config's engine.dtype: auto | bfloat16 | float32
    dtype: str  # what the run computes in: bfloat16 | float32
    device: str  # the resolved engine.device it was decided for
    fast_bf16: bool  # whether that device multiplies bf16 fast
    why: str  # the device's part: "this CPU has AMX (amx_bf16)", ...

    @property
    def line(self) -> str:
        """The choice as the dry run shows it."""
        how = "auto: " if self.given == "auto" else "as given; "
        return f"engine.dtype: {self.dtype} ({how}{self.why})"

    @property
    def note(self) -> str | None:
        """One warning line where bf16 was asked for on a device that computes it slowly."""
        if self.dtype != "bfloat16" or self.fast_bf16:
            return None
        if self.device.startswith("cuda"):
            slow = (
                "its bf16 matrix products are emulated (compute capability below 8.0), far slower than fp32"
            )
        else:
            slow = f"{SLOWER} slower matrix products than fp32 on this CPU (it has no AVX-512 BF16 or AMX)"
        return (
            f"engine.dtype: bfloat16 runs as asked, but {slow}; set engine.dtype: auto or float32 "
            "to compute in fp32 (the store is kept as it is)"
        )

    def record(self) -> dict:
        return {"given": self.given, "dtype": self.dtype, "device": self.device, "fast_bf16": self.fast_bf16}


def choose(engine: EngineConfig, memory: MemoryMode | str = EXACT) -> DtypeChoice:
    """engine.dtype decided for engine.device on this machine. memory: optim.memory's mode, or its
    word (lean keeps a bf16 weight whatever it computes in: the same rule; the reason says what it
    streams)."""
    device = resolve_device(engine)
    if device.startswith("cuda") and not torch.cuda.is_available():
        # a plan for a GPU this machine lacks (a dry run; a real run is refused by check_device):
        # planned as the GPUs that hold these models are, compute capability 8.0 or newer
        fast, why = True, "no GPU here: planned for one with native bf16 (compute capability 8.0 or newer)"
    elif device.startswith("cuda"):
        fast = cuda_bf16(device)
        why = (
            "this GPU computes bf16 natively"
            if fast
            else "this GPU has no native bf16 (compute capability < 8.0)"
        )
    else:
        flags = cpu_bf16_flags()
        fast = bool(flags)
        why = f"this CPU has {'/'.join(flags)}" if fast else "this CPU has no AVX-512 BF16 or AMX"
    dtype = engine.dtype
    if dtype == "auto":
        dtype = "bfloat16" if fast else "float32"
    why += memory_mode(memory).dtype_note(dtype)
    return DtypeChoice(engine.dtype, dtype, device, fast, why)


def grad_dtype_for(given: str, dtype: str, memory: MemoryMode | str = EXACT) -> str:
    """engine.grad_dtype resolved: `auto` is the compute dtype, and bf16 under lean (it holds
    bf16 gradients whatever it computes in: <= 8 B/param). memory: the mode, or its word."""
    return memory_mode(memory).grad_dtype(given, dtype)


def resolve(engine: EngineConfig, memory: MemoryMode | str = EXACT) -> EngineConfig:
    """engine with dtype concrete (as it is when it is already)."""
    if engine.dtype != "auto":
        return engine
    return replace(engine, dtype=choose(engine, memory).dtype)


def with_dtype(cfg: Config) -> tuple[Config, DtypeChoice]:
    """The config with engine.dtype resolved for this machine, and the choice (train, profile)."""
    choice = choose(cfg.engine, cfg.optim.mode)
    return replace(cfg, engine=replace(cfg.engine, dtype=choice.dtype)), choice
