"""One sweep of the layers over a step's micro-batches: what training and inference share.

loads     the sequence of loads the loader streams: every layer forward, the head, then (for a
          training step) every layer again from the top with its saved inputs, except the kept
          layers (engine.kept_layers), whose forward load serves their backward too. A model that runs its
          layers in a loop (arch.calls) runs its sequence of calls instead: call j loads layer
          calls[j]'s unit, forward and backward (every layer once, in order, otherwise: j is i)
start     begin the loads and send the embedded inputs
layers    each layer once over every micro-batch (invariant 2: one transfer serves them all), each
          call as the pass the schedule chose for it runs it (engine.passes: save the input for
          the backward recompute, keep the graph, forward only; generate.decode: decode with a
          KV cache)
head      the final norm's weights and the LM head on the device, for an objective
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..data.batch import MicroBatch
from ..runtime.loader import Load
from .objective import Head
from .parts import Parts
from .seams import Context, Inputs, LayerPass


class Sweep:
    def __init__(self, p: Parts):
        self.p = p

    def contexts(self, mbs: list[MicroBatch]) -> list[Context]:
        """Per micro-batch: positions (the embedding stage's, when it computes them: Qwen2-VL's
        multimodal rotary ids), rotary tables, masks (model.template)."""
        p = self.p
        return [p.tmpl.context(p.embedding.positioned(mb), p.dtype, p.t.device) for mb in mbs]

    def loads(self, passes: Sequence[LayerPass]) -> list[Load]:
        """The sweep's loads: per call its layer's forward load (with the params' extras — LoRA: its
        adapters, once the optimizer has updated them — and the pass's: a generation's cached K/V
        held on the host), the head, then the backward loads the passes ask for, from the top (a
        recomputed layer's, with its saved inputs; a kept layer's forward load serves its backward)."""
        p = self.p
        ready = p.loader.ready
        calls = p.tmpl.calls  # the layer of each call (arch.calls)
        seq = []
        for j, (i, run) in enumerate(zip(calls, passes, strict=True)):
            extra, deps = p.params.extras(i, ready)
            more, more_deps = run.extras(i)
            seq.append(Load(f"f{j}", p.layers[i], [*extra, *more], [*deps, *more_deps], kept=run.kept))
        seq[:0] = p.embedding.loads()  # sharded: the embedding table, gathered on the device first
        seq.append(Load("head", "head"))
        if p.spec.tie_embeddings:
            seq.append(Load("embed", "embed"))
        for j in reversed(range(len(calls))):
            if (back := passes[j].backward_load(j)) is not None:
                seq.append(back)
        return seq

    def start(self, mbs: Inputs, seq: list[Load]) -> list[torch.Tensor]:
        """Begin the step's loads and send the embedded inputs (scaled as the family scales them).
        Layer 0's compute needs only its weights and the embedding rows, so the rows' copy is
        queued right behind W_0, before W_1 (whose load waits for layer 1's update, which the
        CPU optimizer runs after the embedding's): on the in-order copy queue it must not wait
        for that update."""
        p = self.p
        p.loader.begin(seq, ahead=p.embedding.ahead)
        with p.tracer.span("host", "embed"):
            x = p.embedding.forward(mbs)
        p.loader.fill()
        return p.embedding.scale(x)

    @torch.no_grad()
    def layers(
        self, x: list[torch.Tensor], ctxs: list[Context], passes: Sequence[LayerPass]
    ) -> list[torch.Tensor]:
        """Every layer over every micro-batch, call j as its pass runs it (engine.passes)."""
        for j, i in enumerate(self.p.tmpl.calls):  # call j runs layer i (arch.calls; j == i without a loop)
            x = passes[j].run(j, i, x, ctxs)
        return x

    def acquire_head(self) -> Head:
        """The head's weights on the device (the final norm's by name; the LM head, the
        embedding's when tied), as an objective computes with them; `release_head` after."""
        p = self.p
        w = p.params.unit_weights("head", p.loader.acquire("head")[0])  # upcast where narrow
        embed = None
        if p.spec.tie_embeddings:
            embed = p.params.unit_weights("embed", p.loader.acquire("embed")[0])["embed"]
        norm_w, lm = p.tmpl.head_tensors(w, embed)
        return Head(p.tmpl.final_norm, norm_w, lm, p.tmpl.logits, p.cfg.loss_chunk)

    def release_head(self) -> None:
        p = self.p
        p.loader.release("head")
        if p.spec.tie_embeddings:
            p.loader.release("embed")
