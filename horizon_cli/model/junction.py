"""A loop's junctions (arch.calls): the owner's own code between two calls, re-run on real outputs.

When a model runs its layers in a loop, the hidden input of some calls is not the previous call's
output: the owner computes it (Dory: each loop starts from norm(h) + the input section's
normalised output). The probe recorded, per such call j, the earlier calls whose outputs that code
reads. `run` re-runs the owner's forward up to call j with recorders that return those outputs
(x, call j - 1's, as the sweep hands it on; the others held on the device since their forward,
`GenericContext.outs`): transformers' own code computes the input, op for op. It runs without the
cache, and with zeros for the embedding rows and the model-level weights, which the probe checked
it does not read.

Under autograd (the backward recompute of call j) the held outputs pass through `_Sink`: the same
values, their gradients kept per call in `GenericContext.sinks`, and added to the gradient of those
calls' outputs before their own backward (`add_side_grads`); x is differentiated as any layer
input is.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from ..arch.capture import Stop, hidden_of, packed_positions, recorders, rows_embedding
from ..arch.structure import Stack


class _Sink(torch.autograd.Function):
    """The held outputs a junction reads, under autograd: their gradients go into `sinks` (by call);
    x — the junction's own input, which the recompute differentiates — gets zeros, so this runs."""

    @staticmethod
    def forward(ctx, x, sinks, far, *outs):  # type: ignore[override]
        ctx.sinks, ctx.far, ctx.x = sinks, far, (x.shape, x.dtype, x.device)
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        for d, g in zip(ctx.far, grads, strict=True):
            if g is not None:
                ctx.sinks[d] = g if d not in ctx.sinks else ctx.sinks[d] + g
        shape, dtype, device = ctx.x
        return (torch.zeros(shape, dtype=dtype, device=device), None, None, *[None] * len(grads))


class Junctions:
    def __init__(self, s: Stack, owner: nn.Module, emb: nn.Module, layers: list[nn.Module]):
        self.s, self.owner, self.emb, self.layers = s, owner, emb, layers
        self.deps: dict[int, tuple[int, ...]] = dict(s.junctions or {})
        self.held = {d for j, deps in self.deps.items() for d in deps if d != j - 1}  # outputs kept
        self._zeros: dict = {}

    def __contains__(self, j: int) -> bool:
        return j in self.deps

    def run(self, j: int, x: torch.Tensor, ctx, owner_inputs: dict) -> torch.Tensor:
        """Call j's hidden input, from x (call j - 1's output) and the held outputs it reads."""
        deps = self.deps[j]
        far = [d for d in deps if d != j - 1]
        outs = {d: ctx.outs[d] for d in far}
        if far and torch.is_grad_enabled() and x.requires_grad:
            outs = dict(zip(far, _Sink.apply(x, ctx.sinks, far, *[outs[d] for d in far]), strict=True))
        if j - 1 in deps:
            outs[j - 1] = x
        log: list = []
        with (
            _reparametrize_module(self.owner, self._owner_zeros(x.dtype, x.device), strict=False),
            rows_embedding(self.emb, self._zeros_like(x.shape, x.dtype, x.device)),
            recorders(self.layers, log, self.s.returns, None, stop_call=j, outputs=outs),
            packed_positions(self.owner, ctx.pos) if ctx.packed else contextlib.nullcontext(),
            contextlib.suppress(Stop),
        ):
            self.owner(**owner_inputs)
        _, args, kwargs = log[j]
        return hidden_of(args, kwargs)

    def add_side_grads(self, j: int, dx: list[torch.Tensor], ctxs: list) -> None:
        """Before call j's backward: the gradients later junctions sent its output."""
        if j in self.held:
            for m, ctx in enumerate(ctxs):
                g = ctx.sinks.pop(j, None)
                if g is not None:
                    dx[m] = dx[m] + g

    def _zeros_like(self, shape, dtype, device) -> torch.Tensor:
        key = (tuple(shape), dtype, str(device))
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(shape, dtype=dtype, device=device)
        return self._zeros[key]

    def _owner_zeros(self, dtype, device) -> dict[str, torch.Tensor]:
        """The owner's model-level weights (not its layers', not the embedding's) as zeros."""
        cut = len(self.s.owner) + 1
        skip = (self.s.stack[cut:] + ".", self.s.embed[cut:] + ".")
        return {
            n: self._zeros_like(p.shape, dtype if p.is_floating_point() else p.dtype, device)
            for n, p in self.owner.named_parameters()
            if not n.startswith(skip)
        }
