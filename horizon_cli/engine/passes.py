"""What one call of a layer does in a sweep (engine.sweep): a pass object per call, chosen by the
schedule that runs the sweep, so a new kind of layer pass is a new class here, not a branch there.

    ForwardPass    forward only, dropout off: evaluation, scores, a preference run's reference
                   (its template in eval mode: engine.dropout)
    SavePass       a training forward whose backward recomputes: the layer's input goes to the host
                   first (async, overlapping the compute), its backward load brings it back
    KeptPass       a kept layer (engine.kept_layers): run under autograd, graph and weights held until its
                   backward, which needs no second load

A feature's own pass subclasses one of these in its package: generation's `DecodePass`
(generate.decode) binds a layer's KV cache before its compute and keeps it after.

Each answers `extras(i)` (what its forward load carries beyond the params' extras),
`backward_load(j)` (its backward's load, or None), `run(j, i, x, ctxs)` (call j of layer i over
every micro-batch) and, for a training pass, `backward(j, dx, ctxs, gv)` (call j's input gradient
into dx, its leaves' gradients added into gv). Each call over each micro-batch is handed to the
template as a value (`call`: model.call.LayerCall, its global micro-batch counted from mb_base, the
index of this rank's first one, so dropout masks are those of one rank). A training pass runs each
call over each micro-batch in its dropout scope (engine.dropout: the generators seeded by step, call
and global micro-batch), its recompute in the same scope with an equal value, so the backward sees
the forward's masks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch

from ..lora.linear import LayerLora
from ..runtime.events import Event, Promise
from ..runtime.loader import Load
from .kept_layers import KeptLayers
from .parts import Parts
from .seams import Context, LayerCall, LayerTemplate, Weights

Graph = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # a micro-batch's input, output, extra term


class ForwardPass:
    """Load call j's layer, run it over every micro-batch, release it (dropout only when `train`)."""

    kept = False
    train = False

    def __init__(self, p: Parts, mb_base: int = 0):
        self.p, self.mb_base = p, mb_base

    def extras(self, i: int) -> tuple[list[torch.Tensor], list[Event]]:
        return [], []

    def backward_load(self, j: int) -> Load | None:
        return None

    def backward(self, j: int, dx: list[torch.Tensor], ctxs: list[Context], gv: Weights | None) -> None:
        raise AssertionError("a forward-only pass has no backward")

    def run(self, j: int, i: int, x: list[torch.Tensor], ctxs: list[Context]) -> list[torch.Tensor]:
        p = self.p
        w, extras = p.loader.acquire(f"f{j}")
        x = self.compute(j, i, w, self.bind(i, extras), x, ctxs)
        self.after(i)
        p.loader.release(f"f{j}")
        return x

    def bind(self, i: int, extras: list[torch.Tensor]) -> list[torch.Tensor]:
        return extras

    def after(self, i: int) -> None:
        pass

    def call(self, j: int, i: int, m: int, lora: LayerLora | None) -> LayerCall:
        """Call j (of layer i) over this rank's micro-batch m, as the template is handed it."""
        p = self.p
        drops = self.train and p.dropout.active  # the model's own dropout draws in this call
        mb, tile = self.mb_base + m, p.tmpl.seq_tile
        return LayerCall(
            call=j, layer=i, mb=mb, step=p.adam_step, train=self.train, dropout=drops, tile=tile, lora=lora
        )

    def scope(self, c: LayerCall) -> contextlib.AbstractContextManager[None]:
        """The call's dropout scope: a training pass's (engine.dropout), nothing for a forward-only
        one (dropout off)."""
        return self.p.dropout.scope(c.step, c.call, c.mb) if self.train else contextlib.nullcontext()

    def compute(
        self,
        j: int,
        i: int,
        w: dict[str, torch.Tensor],
        extras: list[torch.Tensor],
        x: list[torch.Tensor],
        ctxs: list[Context],
    ) -> list[torch.Tensor]:
        p = self.p
        with p.t.compute_span(f"fwd {j}" if j == i else f"fwd {j} (layer {i})"):
            w = p.params.weights(i, w)
            lora = p.params.layer_lora(i, extras, p.adam_step, train=self.train)
            out = []
            for m, (xm, c) in enumerate(zip(x, ctxs, strict=True)):
                call = self.call(j, i, m, lora)
                with self.scope(call):
                    out.append(p.tmpl.forward(w, xm, c, call))
        return out


class SavePass(ForwardPass):
    """A training forward (dropout on) that saves each call's input to the host for the backward
    recompute. buffers: per call a host buffer; promises: per call the promise of its copy."""

    train = True

    def __init__(
        self, p: Parts, buffers: list[torch.Tensor], promises: list[Promise], total: int, mb_base: int
    ):
        super().__init__(p, mb_base)
        self.buffers, self.promises, self.total = buffers, promises, total
        self.shapes: dict[int, list[torch.Size]] = {}  # call -> the shapes of the inputs it saved

    def backward_load(self, j: int) -> Load | None:
        p = self.p
        i = p.tmpl.calls[j]
        extra, deps = p.params.extras(i, p.loader.ready)
        buf = self.buffers[j][: self.total]
        return Load(f"b{j}", p.layers[i], [*extra, buf], [*deps, self.promises[j]])

    def run(self, j: int, i: int, x: list[torch.Tensor], ctxs: list[Context]) -> list[torch.Tensor]:
        pairs, off = [], 0
        self.shapes[j] = [xm.shape for xm in x]
        for xm in x:
            pairs.append((self.buffers[j][off : off + xm.numel()], xm.reshape(-1)))
            off += xm.numel()
        t = self.p.t
        ev = t.d2h(pairs, [t.record()], label=f"save{j}")
        self.promises[j].set(ev)  # the transport keeps x alive until the copy has read it
        return super().run(j, i, x, ctxs)

    def backward(self, j: int, dx: list[torch.Tensor], ctxs: list[Context], gv: Weights | None) -> None:
        """Load call j's layer again with its saved inputs and recompute it under autograd for every
        micro-batch: its input gradient into dx, the leaves' gradients added (fp32) into gv."""
        p = self.p
        i = p.tmpl.calls[j]
        w, extras = p.loader.acquire(f"b{j}")
        saved = extras[-1]
        with p.t.compute_span(f"bwd {j}" if j == i else f"bwd {j} (layer {i})"):
            w = p.params.weights(i, w)
            w, lora, leaves, names = p.params.leaves(i, w, extras, p.adam_step)
            want_dx = j > 0 or p.params.wants_dx(i) or p.embedding.stage_trained
            offs, ins = [0], self.shapes[j]  # the inputs' shapes, as the forward saved them
            for shape in ins:
                offs.append(offs[-1] + math.prod(shape))

            def graph(m: int) -> Graph:
                xi = saved[offs[m] : offs[m + 1]].view(ins[m]).detach().requires_grad_(want_dx)
                call = self.call(j, i, m, lora)  # the forward's: its masks (engine.dropout, LoRA's)
                with self.scope(call):
                    y, extra = p.tmpl.objective(w, xi, ctxs[m], call)
                return xi, y, extra

            if want_dx or leaves:
                backprop(p.tmpl, i, ctxs, graph, leaves, names, dx, want_dx, gv)
        p.loader.release(f"b{j}")


class KeptPass(ForwardPass):
    """A kept layer: its forward's load and graph are held (engine.kept_layers) until its backward."""

    kept = True
    train = True  # dropout on, as in SavePass

    def __init__(self, p: Parts, keep: KeptLayers, mb_base: int):
        super().__init__(p, mb_base)
        self.keep = keep

    def run(self, j: int, i: int, x: list[torch.Tensor], ctxs: list[Context]) -> list[torch.Tensor]:
        p = self.p
        w, extras = p.loader.acquire(f"f{j}")
        with p.t.compute_span(f"fwd {j} kept", kept=True):
            return self.keep.forward(j, w, extras, x, ctxs, lambda m, lora: self.call(j, i, m, lora))

    def backward(self, j: int, dx: list[torch.Tensor], ctxs: list[Context], gv: Weights | None) -> None:
        """The graph the forward held, then the forward's load is released (held until now)."""
        p = self.p
        with p.t.compute_span(f"bwd {j} kept", kept=True):
            graph, h = self.keep.take(j, ctxs)
            if h.want_dx or h.leaves:
                backprop(p.tmpl, p.tmpl.calls[j], ctxs, graph, h.leaves, h.names, dx, h.want_dx, gv)
        p.loader.release(f"f{j}")


def backprop(
    tmpl: LayerTemplate,
    i: int,
    ctxs: list[Context],
    graph: Callable[[int], Graph],
    leaves: list[torch.Tensor],
    names: list[str],
    dx: list[torch.Tensor],
    want_dx: bool,
    gv: Weights | None,
) -> None:
    """Backpropagate layer i's graph of each micro-batch (graph(m): input, output, auxiliary
    term or None), in order: the input gradient into dx[m], the leaves' gradients added (fp32)
    into gv, its side inputs' (tensors crossing layers, model.side) back to the template."""
    for m in range(len(ctxs)):
        with torch.enable_grad():
            xi, y, extra = graph(m)
            side = tmpl.side_inputs(i, ctxs[m])
            outs, seeds = ([y], [dx[m]]) if extra is None else ([y, extra], [dx[m], torch.ones_like(extra)])
            inputs = [xi, *leaves, *side] if want_dx else [*leaves, *side]
            grads = torch.autograd.grad(outs, inputs, seeds, allow_unused=True)
        if side:
            tmpl.side_grads(i, ctxs[m], grads[len(grads) - len(side) :])
            grads = grads[: len(grads) - len(side)]
        if want_dx:
            dx[m], grads = grads[0], grads[1:]
        for name, gw in zip(names, grads, strict=True):
            if gw is not None:  # None: a tensor this micro-batch never reached (an unrouted expert bias)
                assert gv is not None  # leaves come with their gradient's views (GradSums.buffer)
                gv[name].add_(gw)  # fp32 accumulation across micro-batches
