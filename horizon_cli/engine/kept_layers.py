"""Kept layers (`engine.keep_activations`): the last K layers of the forward keep their autograd
graph, and their weights on the device, until their backward — the first layers the backward
visits. They are neither recomputed nor loaded a second time: a step moves 2L - K layer loads.

    forward   layer i >= L - K runs under autograd with the leaves its backward recompute would
              make (the trainable weights, or the LoRA adapters), on its input detached: the graph
              recompute would build, the same ops on the same inputs, so kept and recomputed runs
              give the same model bit for bit. Its output goes on detached (invariant 3: no graph
              spans more than one layer); its weights stay in a buffer of its own (runtime.loader),
              its input is not saved to the host.
    backward  the held graph of every micro-batch, with the MoE auxiliary term added from the
              router logits it held (model.template.held_objective: the aux scale is known only
              after every layer's forward), then the weights' buffer is released.

How many layers is the plan's decision (planning.keep); the engine is given K.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..lora.linear import LayerLora
from .parts import Parts
from .seams import Context, LayerCall, Weights

Graph = tuple[torch.Tensor, torch.Tensor, object]  # a kept micro-batch's input, output, held

Calls = Callable[[int, LayerLora | None], LayerCall]  # micro-batch m, the adapters -> the call over it


@dataclass
class Held:
    """One kept layer's graphs, from its forward to its backward."""

    graphs: list[Graph | None]  # per micro-batch: input, output, held (None: given up)
    leaves: list[torch.Tensor]  # what the backward differentiates (as the recompute's leaves)
    names: list[str]
    want_dx: bool


class KeptLayers:
    def __init__(self, p: Parts):
        self.p = p
        self.first = len(p.tmpl.calls) - p.keep  # layers first.. L-1 are kept (a loop keeps none)
        self.held: dict[int, Held] = {}

    def __contains__(self, i: int) -> bool:
        return i >= self.first

    def forward(
        self,
        i: int,
        w: Weights,
        extras: list[torch.Tensor],
        x: list[torch.Tensor],
        ctxs: list[Context],
        calls: Calls,
    ) -> list[torch.Tensor]:
        """Layer i over every micro-batch m under autograd as `calls(m, adapters)`, each in its
        dropout scope (engine.dropout: the masks its held graph keeps); the graphs are held, the
        outputs detached."""
        p = self.p
        w, lora, leaves, names = p.params.leaves(i, p.params.weights(i, w), extras, p.adam_step)
        want_dx = p.params.wants_dx(i) or p.embedding.stage_trained
        graphs: list[Graph | None] = []
        out = []
        with torch.enable_grad():
            for m, (xm, c) in enumerate(zip(x, ctxs, strict=True)):
                xi = xm.detach().requires_grad_(want_dx)
                call = calls(m, lora)  # its global micro-batch: dropout masks as on one rank
                with p.dropout.scope(call.step, call.call, call.mb):
                    y, held = p.tmpl.forward_held(w, xi, c, call)
                graphs.append((xi, y, held))
                out.append(y.detach())
        self.held[i] = Held(graphs, leaves, names, want_dx)
        return out

    def take(self, i: int, ctxs: list[Context]) -> tuple[Callable[[int], tuple], Held]:
        """Layer i's backward: per micro-batch (input, output, auxiliary term or None), each given
        up once used (autograd.grad frees its graph), and the layer's leaves."""
        h = self.held.pop(i)

        def graph(m: int) -> tuple:
            got, h.graphs[m] = h.graphs[m], None
            assert got is not None, "a kept graph is taken once"
            xi, y, held = got
            return xi, y, self.p.tmpl.held_objective(held, ctxs[m])

        return graph, h

    def clear(self) -> None:
        """Drop every held graph (a step that stopped half-way)."""
        self.held.clear()
