"""Layers run in a loop: an owner whose forward calls some decoder layers more than once (Dory's
recurrent section, weight-shared passes).

    calls      the layer of each call the owner makes, in order (arch.probe); a layer called twice
               (or out of order) makes a loop, and the streamed engine then runs the sequence of
               calls rather than of layers (`sequence`): call j loads layer calls[j]'s unit
    junctions  a call whose hidden input is not the previous call's output: the owner's own code
               runs between the two (Dory: each loop starts from norm(h) + the input section's
               normalised output). For each such call, the earlier calls whose outputs that code
               reads. The engine re-runs the owner's forward up to the call, with those outputs
               (model.generic); that code may use no trained weight and not the embedding (it is
               re-run without them)

Observed on the meta device: each call's recorder returns a leaf of its own, and autograd says
which leaves the next hidden input depends on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from ..errors import InputError
from .capture import hidden_of
from .generic_arch import GenericArch
from .structure import Stack


class Layered(Protocol):
    """What `spec_sequence` reads of an ArchSpec (arch.spec imports this module)."""

    n_layers: int
    generic: GenericArch | None


def is_loop(calls: Sequence[int]) -> bool:
    return len(set(calls)) != len(calls) or list(calls) != sorted(calls)


def sequence(s: Stack | None, n_layers: int) -> list[int]:
    """The layer of each call the engine runs: the probe's calls for a loop, else every layer in
    order (a layer the owner skips passes its input through, model.generic)."""
    calls = list(s.calls) if s is not None else []
    return calls if calls and is_loop(calls) else list(range(n_layers))


def spec_sequence(spec: Layered) -> list[int]:
    """`sequence` of an ArchSpec (native: every layer once)."""
    g = spec.generic
    return sequence(g.model if g is not None else None, spec.n_layers)


def junctions(
    run: Callable[[dict | None], list], owner: nn.Module, stack: str, where: str
) -> dict[int, tuple[int, ...]]:
    """{call: the earlier calls whose outputs its hidden input reads} for
    every call whose input is not simply the previous call's output. run(outputs): the owner's
    meta forward with recorders returning outputs[k] from call k (arch.probe), its call log."""
    name = type(owner).__name__
    first = run(None)
    outs = {}
    for k, (_, args, kwargs) in enumerate(first):
        h = hidden_of(args, kwargs)
        outs[k] = torch.empty(h.shape, dtype=h.dtype, device="meta", requires_grad=True)
    log = run(outs)
    cut = stack.rpartition(".")[2] + "."
    weights = [(n, p) for n, p in owner.named_parameters() if p.requires_grad and not n.startswith(cut)]
    found: dict[int, tuple[int, ...]] = {}
    for k in range(1, len(log)):
        i, args, kwargs = log[k]
        h = hidden_of(args, kwargs)
        if h is outs[k - 1]:
            continue
        if not isinstance(h, torch.Tensor) or not h.requires_grad:
            raise InputError(
                f"{where}: {name}'s call {k} (layer {i}) does not take a layer's output: not supported"
            )
        leaves = [outs[m] for m in range(k)] + [p for _, p in weights]
        grads = torch.autograd.grad(h, leaves, torch.ones_like(h), allow_unused=True, retain_graph=True)
        used = [weights[n][0] for n, g in enumerate(grads[k:]) if g is not None]
        if used:
            raise InputError(
                f"{where}: {name} computes the input of call {k} (layer {i}) with its weight {used[0]} "
                "between the calls of its loop: trained model-level code between layers is not supported"
            )
        found[k] = tuple(m for m in range(k) if grads[m] is not None)
        if not found[k]:
            raise InputError(f"{where}: {name}'s call {k} (layer {i}) reads no layer's output: not supported")
    return found
