"""What one call of a layer does in a sweep (engine.sweep): a pass object per call, chosen by the
schedule that runs the sweep, so a new kind of layer pass is a new class here, not a branch there.

    ForwardPass    forward only, dropout off: evaluation, scores, a preference run's reference
    SavePass       a training forward whose backward recomputes: the layer's input goes to the host
                   first (async, overlapping the compute), its backward load brings it back
    KeptPass       a kept layer (engine.keep): run under autograd, graph and weights held until its
                   backward, which needs no second load
    DecodePass     a generation sweep with a KV cache (engine.kvcache): the layer's cached K/V bound
                   before its compute and kept after it (host mode: they ride with its load)

Each answers `extras(i)` (what its forward load carries beyond the params' extras),
`backward_load(j)` (its backward's load, or None) and `run(j, i, x, ctxs)` (call j of layer i over
every micro-batch). mb_base: the global index of this rank's first micro-batch, so dropout masks
are those of one rank.
"""

from __future__ import annotations

import torch

from ..runtime.events import Event, Promise
from ..runtime.loader import Load
from .keep import KeptLayers
from .kvcache import KVCache
from .parts import Parts
from .seams import Context


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

    def compute(
        self, j: int, i: int, w: dict[str, torch.Tensor], extras: list[torch.Tensor],
        x: list[torch.Tensor], ctxs: list[Context],
    ) -> list[torch.Tensor]:  # fmt: skip
        p = self.p
        with p.t.compute_span(f"fwd {j}" if j == i else f"fwd {j} (layer {i})"):
            w = p.params.weights(i, w)
            lora = p.params.layer_lora(i, extras, p.adam_step, train=self.train)
            out = []
            for m, (xm, c) in enumerate(zip(x, ctxs, strict=True)):
                if lora is not None:  # a loop's later calls: dropout masks of their own
                    lora.mb = self.mb_base + m if j == i else (self.mb_base + m, j)
                out.append(p.tmpl.forward(j, w, xm, c, lora))
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


class KeptPass(ForwardPass):
    """A kept layer: its forward's load and graph are held (engine.keep) until its backward."""

    kept = True

    def __init__(self, p: Parts, keep: KeptLayers, mb_base: int):
        super().__init__(p, mb_base)
        self.keep = keep

    def run(self, j: int, i: int, x: list[torch.Tensor], ctxs: list[Context]) -> list[torch.Tensor]:
        p = self.p
        w, extras = p.loader.acquire(f"f{j}")
        with p.t.compute_span(f"fwd {j} kept", kept=True):
            return self.keep.forward(j, w, extras, x, ctxs, self.mb_base)


class DecodePass(ForwardPass):
    """A generation sweep: the layer computes with its KV cache, which keeps the new positions."""

    def __init__(self, p: Parts, kv: KVCache):
        super().__init__(p)
        self.kv = kv

    def extras(self, i: int) -> tuple[list[torch.Tensor], list[Event]]:
        return self.kv.extras(i)

    def bind(self, i: int, extras: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.kv.bind(i, extras)  # the params' extras remain

    def after(self, i: int) -> None:
        self.kv.keep(i)
