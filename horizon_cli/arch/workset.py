"""What a recurrent mixer saves for its backward, measured on the meta device (no memory).

The memory plan estimates a generic layer's working set from its tensor table (every
projection's output per token, planning.memory.generic_work_bytes). A recurrent or linear-attention
mixer on transformers' pure-torch path (Gated DeltaNet's chunked delta rule, Mamba-2's SSD scan,
short convolutions) saves far more than its projections: per chunk its decay matrices and
recurrent states, several times the hidden size per token. Rather than a formula per kernel, the
probe runs the mixer itself once per layer kind on the meta device, at the model's real sizes and
two sequence lengths, under autograd with a saved-tensor hook, and records the bytes it saves
(weights excluded) as `rows * (fixed + per_token * T)` for fp32 and bf16. A mixer whose code cannot
run on the meta device gets no entry: the plan keeps its table estimate for it.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from .capture import Stop, recorders
from .generic_arch import Mixer
from .probe import _no_packing_check
from .structure import Stack

LENGTHS = (256, 512)  # multiples of every chunk size in transformers' kernels (64, 128, 256)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _Got(Exception):
    """Raised by the pre-hook that records the mixer's call."""


def _mixer(layer: nn.Module, pattern) -> tuple[str, nn.Module] | None:
    """The outermost module of the layer whose class name says recurrent, with its path."""
    for path, mod in layer.named_modules():
        if path and pattern.search(type(mod).__name__):
            return path, mod
    return None


def _mixer_call(layer: nn.Module, mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The (args, kwargs) the layer passes its mixer, on the meta device."""
    got: dict = {}

    def pre(_mod, a, k):
        got["call"] = (a, k)
        raise _Got

    hook = mod.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad(), contextlib.suppress(_Got):
            layer(*args, **kwargs)
    finally:
        hook.remove()
    if "call" not in got:
        raise RuntimeError("the layer does not call its mixer")
    return got["call"]


def _as(t, dtype: torch.dtype, grad: bool):
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        t = t.detach().to(dtype)
        return t.requires_grad_(True) if grad else t
    return t


def _saved_bytes(mod: nn.Module, call: tuple[tuple, dict], dtype: torch.dtype) -> int:
    """Bytes autograd saves running `mod` on `call` in `dtype` (the call's hidden input a leaf)."""
    args, kwargs = call
    mod = copy.deepcopy(mod).to(dtype)  # meta: nothing is copied
    weights = {id(p) for p in mod.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if id(t) not in weights:
            seen[id(t)] = t.numel() * t.element_size()
        return t

    a = tuple(_as(t, dtype, i == 0) for i, t in enumerate(args))
    k = {n: _as(t, dtype, n == "hidden_states") for n, t in kwargs.items()}
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mod(*a, **k)
    return sum(seen.values())


def measure(
    owner: nn.Module, layers: list[nn.Module], s: Stack, layer_kinds: list[str], pattern
) -> dict[str, Mixer]:
    """Per layer kind holding a recurrent mixer: its path in the layer and per dtype name (fixed
    bytes per row, bytes per token) (module doc); kinds that cannot run on meta left out."""
    mixers: dict[int, tuple[str, nn.Module]] = {}
    for i in s.calls:
        found = _mixer(layers[i], pattern)
        if found is not None and layer_kinds[i] not in {layer_kinds[j] for j in mixers}:
            mixers[i] = found
    if not mixers:
        return {}
    calls: dict[int, dict[int, tuple]] = {}
    for T in LENGTHS:
        log: list = []
        try:
            with (
                torch.no_grad(),
                _no_packing_check(),
                recorders(layers, log, s.returns, None),
                contextlib.suppress(Stop),
            ):
                owner(input_ids=torch.zeros(1, T, dtype=torch.long, device="meta"), **_cache_off(s))
        except Exception:  # noqa: BLE001 (the owner's code needs values the meta device has not)
            return {}
        calls[T] = {i: (args, kwargs) for i, args, kwargs in log}
    out: dict[str, Mixer] = {}
    for i, (path, mod) in mixers.items():
        try:
            sizes = {}
            for T in LENGTHS:
                args, kwargs = calls[T][i]
                call = _mixer_call(layers[i], mod, args, kwargs)
                sizes[T] = {n: _saved_bytes(mod, call, dt) for n, dt in DTYPES.items()}
        except Exception:  # noqa: BLE001 (meta kernels are incomplete: the table estimate stands)
            continue
        t1, t2 = LENGTHS
        saved: dict[str, tuple[float, float]] = {}
        for n in DTYPES:
            per_token = max((sizes[t2][n] - sizes[t1][n]) / (t2 - t1), 0.0)
            saved[n] = (max(sizes[t1][n] - per_token * t1, 0.0), per_token)
        out[layer_kinds[i]] = Mixer(path, saved)
    return out


def _cache_off(s: Stack) -> dict:
    return {"use_cache": False} if "use_cache" in s.owner_kwargs else {}
