"""The device the engine computes on: `engine.device` resolved, checked, and its transport made.

`auto` is CUDA when present, unless a link is to be emulated (`engine.link_gbps` or
`engine.link_chaos`, CPU only). On the
CPU the "device" is host memory and copies are copies (runtime.transport); on CUDA they run on copy
streams (runtime.cuda).
"""

from __future__ import annotations

import torch

from ..config.schema import EngineConfig
from ..errors import InputError
from .trace import Tracer


def resolve_device(cfg: EngineConfig) -> str:
    """engine.device with `auto` decided: CUDA when present, unless a link is to be emulated."""
    if cfg.device != "auto":
        return cfg.device
    return "cuda" if torch.cuda.is_available() and not (cfg.link_gbps or cfg.link_chaos) else "cpu"


def has_link(cfg: EngineConfig) -> bool:
    """Whether host and device are apart (CUDA, or an emulated link): a load then copies bytes
    across, and a narrow streaming copy crosses as held (state.widen); on the CPU without an
    emulated link the loader lends the host's buffers instead."""
    return resolve_device(cfg).startswith("cuda") or cfg.link_gbps > 0 or cfg.link_chaos


def check_device(cfg: EngineConfig) -> str:
    """engine.device resolved (auto decided); InputError when it names a GPU this machine lacks."""
    dev = resolve_device(cfg)
    if not dev.startswith("cuda"):
        return dev
    if not torch.cuda.is_available():
        built = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise InputError(f"engine.device: {dev} requested, but {built} (use engine.device: cpu or auto)")
    idx = int(dev.split(":")[1]) if ":" in dev else 0
    n = torch.cuda.device_count()
    if idx >= n:
        raise InputError(f"engine.device: {dev} requested, but this machine has {n} CUDA device(s)")
    return dev


def cuda_index(device: str) -> int:
    """The CUDA device `device` ("cuda" or "cuda:N") names; exit 2 if there is none such."""
    if not torch.cuda.is_available():
        raise InputError(f"engine.device: {device}, but no CUDA device is available")
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index >= torch.cuda.device_count():
        raise InputError(f"engine.device: {device}, but there are {torch.cuda.device_count()} CUDA device(s)")
    return index


def make_transport(cfg: EngineConfig, tracer: Tracer):
    dev = resolve_device(cfg)
    if dev.startswith("cuda"):
        from .cuda import CudaTransport

        return CudaTransport(torch.device(dev), tracer=tracer)
    if cfg.link_chaos:
        from .chaos import ChaosTransport

        return ChaosTransport(tracer=tracer)
    from .transport import CpuTransport

    return CpuTransport(cfg.link_gbps, tracer=tracer)
