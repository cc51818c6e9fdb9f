"""What crosses a probed model's layers besides the hidden state (arch.probe's events).

side inputs  arguments of layers after the first computed from trained weights before the layers
             (Gemma 4's per-layer inputs, Zamba 2's embedding output): the template gives each its
             gradient back (model.side); one inside a container of tensors cannot be, and is refused
"""

from __future__ import annotations

import torch

from ..errors import InputError
from .structure import Crossing, How


def grad_tensors(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.requires_grad
    if isinstance(v, (tuple, list)):
        return any(grad_tensors(x) for x in v)
    if isinstance(v, dict):
        return any(grad_tensors(x) for x in v.values())
    return False


def side_inputs(events: list[tuple], where: str) -> tuple[Crossing, ...]:
    """Where layers after the first take tensors computed from trained weights before the layers
    (Gemma 4's per-layer inputs, Zamba's embedding output): [layer, "arg", j] / [layer, "kw", name].
    The template gives each its gradient back (model.generic); one inside a container cannot be."""
    side: list[Crossing] = []
    for i, ev in enumerate(x for x in events if x[0] == "layer"):
        if not i:
            continue
        _, args, kwargs = ev[3]
        slots: list[tuple[How, int | str, object]] = [("arg", j + 1, v) for j, v in enumerate(args[1:])]
        slots += [("kw", k, v) for k, v in kwargs.items()]
        for how, key, v in slots:
            if not grad_tensors(v) or (not args and key == "hidden_states"):
                continue
            if not isinstance(v, torch.Tensor):
                what = repr(key) if how == "kw" else f"its positional argument {key}"
                raise InputError(
                    f"{where}: layer {ev[1]} receives {what}, a {type(v).__name__} of tensors computed from "
                    "trained weights before the layers (crossing layers besides the hidden state): not supported"
                )
            side.append(Crossing(ev[1], how, key))
    return tuple(side)


def side_width(events: list[tuple], side: tuple[Crossing, ...], tokens: int) -> int:
    """Elements per token of the distinct side tensors (planning.memory: they stay on the device
    for the step, with their gradients)."""
    calls = {e[1]: e[3] for e in events if e[0] == "layer"}
    seen: dict[int, int] = {}
    for c in side:
        _, args, kwargs = calls[c.at]
        v = args[c.key] if c.how == "arg" else kwargs[c.key]
        seen[id(v)] = v.numel() // tokens
    return sum(seen.values())
