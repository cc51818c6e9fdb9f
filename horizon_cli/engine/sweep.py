"""One sweep of the layers over a step's micro-batches: what training and inference share.

loads     the sequence of loads the loader streams: every layer forward, the head, then (for a
          training step) every layer again from the top with its saved inputs, except the kept
          layers (engine.keep), whose forward load serves their backward too. A model that runs its
          layers in a loop (arch.loop) runs its sequence of calls instead: call j loads layer
          calls[j]'s unit, forward and backward (every layer once, in order, otherwise: j is i)
start     begin the loads and send the embedded inputs
layers    each layer once over every micro-batch (invariant 2: one transfer serves them all),
          optionally saving each layer's input to the host for the backward recompute, or (a
          kept layer) holding its graph and weights for the backward instead
head      the final norm's weights and the LM head on the device, for an objective
"""

from __future__ import annotations

import torch

from ..data.batch import MicroBatch
from ..runtime.events import Promise
from ..runtime.loader import Load
from .keep import KeptLayers
from .objective import Head
from .parts import Parts


class Sweep:
    def __init__(self, p: Parts):
        self.p = p
        self.saved: dict[int, list[torch.Size]] = {}  # call -> the shapes of the inputs it saved

    def contexts(self, mbs: list[MicroBatch]) -> list:
        """Per micro-batch: positions, rotary tables, masks (model.template)."""
        p = self.p
        return [p.tmpl.context(mb, p.dtype, p.t.device) for mb in mbs]

    def loads(
        self, backward: list[tuple[torch.Tensor, Promise]] | None = None, kept: int = 0, kv=None
    ) -> list[Load]:
        """The step's loads: forward layers, the head, then (with `backward`: per layer its saved
        inputs and the promise of their copy) the backward layers but the `kept` last ones, whose
        forward loads go to buffers of their own. A layer's extras (LoRA: its adapters) come along
        once the optimizer has updated them; with `kv` (a generation's KV cache held on the host,
        engine.kvcache) so do the layer's cached K/V, once written back. A forward-only pass
        (`backward` None: evaluation, generation) keeps nothing."""
        p = self.p
        ready = p.loader.ready
        assert backward is not None or kept == 0, "only a training step keeps layers"
        calls = p.tmpl.calls  # the layer of each call (arch.loop)
        first = len(calls) - kept
        seq = []
        for j, i in enumerate(calls):
            extra, deps = p.params.extras(i, ready)
            if kv is not None:
                kv_extra, kv_deps = kv.extras(i)
                extra, deps = [*extra, *kv_extra], [*deps, *kv_deps]
            seq.append(Load(f"f{j}", p.layers[i], extra, deps, kept=j >= first))
        if p.dist is not None:  # the embedding table, gathered on the device first
            seq.insert(0, Load("embed-in", "embed"))
        seq.append(Load("head", "head"))
        if p.spec.tie_embeddings:
            seq.append(Load("embed", "embed"))
        if backward is not None:
            for j in reversed(range(first)):
                extra, deps = p.params.extras(calls[j], ready)
                buf, saved = backward[j]
                seq.append(Load(f"b{j}", p.layers[calls[j]], [*extra, buf], [*deps, saved]))
        return seq

    def start(self, mbs: list[MicroBatch], seq: list[Load]) -> list[torch.Tensor]:
        """Begin the step's loads and send the embedded inputs (scaled as the family scales them).
        Layer 0's compute needs only its weights and the embedding rows, so the rows' copy is
        queued right behind W_0, before W_1 (whose load waits for layer 1's update, which the
        CPU optimizer runs after the embedding's): on the in-order copy queue it must not wait
        for that update."""
        p = self.p
        p.loader.begin(seq, ahead=1 if p.dist is None else 2)
        with p.tracer.span("host", "embed"):
            x = p.embedding.forward(mbs)
        p.loader.fill()
        return p.embedding.scale(x)

    @torch.no_grad()
    def layers(
        self,
        x: list[torch.Tensor],
        ctxs: list,
        mb_base: int = 0,
        save: tuple[list[torch.Tensor], list[Promise]] | None = None,
        keep: KeptLayers | None = None,
        kv=None,
    ) -> list[torch.Tensor]:
        """Every layer over every micro-batch. save: (per layer a host buffer, the promise of its
        copy): each layer's input goes to the host first, for the backward recompute (async,
        overlapping the compute); a training forward (dropout on). mb_base: the global index of
        this rank's first micro-batch (dropout masks as on one rank). keep: the kept layers, run
        under autograd and held (their loads stay acquired until their backward releases them); a
        training step's only. kv: a generation's KV cache (engine.kvcache): its layer's K/V bound
        before the compute, kept after it."""
        p = self.p
        assert keep is None or kv is None, "a generation keeps no graphs"
        for j, i in enumerate(p.tmpl.calls):  # call j runs layer i (arch.loop; j == i without a loop)
            if keep is not None and j in keep:
                w, extras = p.loader.acquire(f"f{j}")
                with p.t.compute_span(f"fwd {j} kept", kept=True):
                    x = keep.forward(j, w, extras, x, ctxs, mb_base)
                continue
            if save is not None:
                buffers, promises = save
                pairs, off = [], 0
                self.saved[j] = [xm.shape for xm in x]
                for xm in x:
                    pairs.append((buffers[j][off : off + xm.numel()], xm.reshape(-1)))
                    off += xm.numel()
                ev = p.t.d2h(pairs, [p.t.record()], label=f"save{j}")
                promises[j].set(ev)  # the transport keeps x alive until the copy has read it
            w, extras = p.loader.acquire(f"f{j}")
            if kv is not None:
                extras = kv.bind(i, extras)  # the params' extras remain
            with p.t.compute_span(f"fwd {j}" if j == i else f"fwd {j} (layer {i})"):
                w = p.params.weights(i, w)
                lora = p.params.layer_lora(i, extras, p.adam_step, train=save is not None)
                out = []
                for m, (xm, c) in enumerate(zip(x, ctxs, strict=True)):
                    if lora is not None:  # a loop's later calls: dropout masks of their own
                        lora.mb = mb_base + m if j == i else (mb_base + m, j)
                    out.append(p.tmpl.forward(j, w, xm, c, lora))
                x = out
            if kv is not None:
                kv.keep(i)
            p.loader.release(f"f{j}")
        return x

    def acquire_head(self) -> Head:
        """The head's weights on the device (the final norm's by name; the LM head, the
        embedding's when tied), as an objective computes with them; `release_head` after."""
        p = self.p
        w, _ = p.loader.acquire("head")
        embed = p.loader.acquire("embed")[0]["embed"] if p.spec.tie_embeddings else None
        norm_w, lm = p.tmpl.head_tensors(w, embed)
        return Head(p.tmpl.final_norm, norm_w, lm, p.tmpl.logits, p.cfg.loss_chunk)

    def release_head(self) -> None:
        p = self.p
        p.loader.release("head")
        if p.spec.tie_embeddings:
            p.loader.release("embed")
