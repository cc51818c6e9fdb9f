"""One optimizer step, layer by layer: the heart of horizon.

    forward   for each layer i: load W_i once; save its input x_i to the host; x = layer(W_i, x) for
              every micro-batch (engine.sweep)
    head      the objective (engine.objective) on the last hidden states of every micro-batch:
              final norm + LM head in chunks, its backward at once (head weights load once)
    backward  for each layer i from the top: load W_i again with the saved x_i; recompute the layer
              under autograd (the only graph, one layer deep), backpropagate every micro-batch,
              accumulate parameter grads in fp32 and send them to the host (engine.grads,
              engine.reduce). A kept layer (the last K, engine.kept_layers) uses the graph its forward
              held instead: no recompute, no second load
    embed     the input gradient into the embedding's fp32 grad (engine.embed)
    optimize  with the global grad norm known, AdamW runs on the CPU unit by unit, overlapped
              with the next step's forward (which waits per unit, in the same order); with
              gradient release (optim.grad_release: engine.release) each unit's update is queued
              inside the backward as soon as its gradient is whole, overlapping the layers below

Each decoder layer's weights cross host -> device twice per step (a kept layer's once: 2L - K
loads), whatever the number of micro-batches (invariant 2). A model that runs its layers in a loop
(arch.calls) runs its C calls instead (2C loads): call j loads layer calls[j]'s unit and saves its
input; the backward visits the calls from the last, each call's weight gradient accumulating into
its unit's, which goes to the host (and the optimizer) after the unit's earliest call only. What
is trained (engine.params, the head's share engine.headgrad) and where gradients go (engine.reduce)
are strategies of `Parts`, chosen once; what each call does forward and backward is its pass
(engine.passes: SavePass recomputes, KeptPass holds its graph), chosen per step here. See
docs/engine.md.
"""

from __future__ import annotations

import math

import torch

from ..data.batch import MicroBatch
from ..errors import HorizonError
from ..faults import mark, nan_grad
from ..optim.adamw import AdamWHyper
from ..planning.memory import head_work_bytes, kept_graph_bytes, layer_vectors, layer_work_bytes
from ..runtime.events import Event, Promise
from .kept_layers import KeptLayers
from .objective import HeadOut, Targets
from .parts import Parts
from .passes import KeptPass, SavePass
from .release import NoRelease, Release
from .seams import Context, LayerPass
from .sweep import Sweep


class TrainStep:
    def __init__(self, p: Parts, sweep: Sweep):
        self.p, self.sweep = p, sweep
        self.ckpt: list[torch.Tensor] = []  # per layer: saved inputs of every micro-batch, flat, on the host
        self.kept = KeptLayers(p)  # the last K layers' graphs, from their forward to their backward
        self.recomputed = len(p.tmpl.calls) - p.keep  # calls 0 .. recomputed-1 save inputs and recompute
        self.vectors = layer_vectors(p.params.units[u].layout for u in p.layers) if p.keep else 0
        self.grad_ready: dict[str, Event] = {}  # unit -> its gradient is on the host (this step)
        self.mb_base = 0  # sharded runs: the global index of this rank's first micro-batch
        self.passes: list[LayerPass] = []  # this step's pass of each call (engine.passes)
        self.release = NoRelease()  # what the backward does with each whole gradient (engine.release)

    def reserve(self, step_numel: int) -> None:
        """Size the host buffers once (pinning and unpinning L buffers mid-run doubles them)."""
        self._ensure_ckpt(step_numel)
        self.p.head.reserve(step_numel)

    def forward_backward(
        self, mbs: list[MicroBatch], tokens: int | None = None
    ) -> tuple[float, int, float, dict[str, float]]:
        """Fill every trained unit's host grad with d(mean loss)/dW. Returns (loss sum, divisor,
        squared global grad norm, the objective's stat sums), the global batch's (every rank's).
        tokens: the divisor of the global batch (sharded runs; default: this batch's)."""
        p = self.p
        tokens = p.objective.divisor(mbs) if tokens is None else tokens
        self.mb_base = p.ranks.rank * len(mbs)  # sharded: this rank's first global micro-batch
        inv_n = 1.0 / tokens if tokens else 0.0
        ctxs = self.sweep.contexts(mbs)
        targets = p.objective.targets(mbs, p.t.device)  # before any compute is queued
        shapes = [tuple(mb.input_ids.shape) for mb in mbs]  # (b, T) per micro-batch
        total = sum(b * T for b, T in shapes) * p.spec.boundary_width  # what crosses a layer, at most
        self._ensure_ckpt(total)
        saved = p.poison.promises(self.recomputed)
        self._account(shapes)
        self.grad_ready = {}
        sq: list[torch.Tensor] = []
        p.reduce.begin_step()

        p.tmpl.begin_step()
        self.kept.clear()
        self.passes = self._passes(saved, total)
        x = self.sweep.start(mbs, self.sweep.loads(self.passes))
        x = self.sweep.layers(x, ctxs, self.passes)
        p.tmpl.end_forward()  # MoE: every layer's routing is known, the aux loss with it
        out = self._head(x, targets, inv_n, sq)
        dx = self._backward_layers(out.dx, ctxs, sq)
        with p.tracer.span("host", "embed grad + norm"):
            host_sq = p.head.embed_backward(dx, mbs, self.grad_ready)
            self.release.rest(self.grad_ready, host_sq)
            loss, sq_all, stats = p.reduce.total(out.loss_sum, sq, host_sq, out.stats)
        return loss, tokens, sq_all, stats

    def apply_update(self, lr: float, norm: float) -> None:
        p, o = self.p, self.p.ocfg
        clip = o.grad_clip
        scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0  # torch.nn.utils.clip_grad_norm_
        p.adam_step += 1
        h = AdamWHyper(lr, o.betas[0], o.betas[1], o.eps, o.weight_decay, p.adam_step, scale)
        p.embedding.update(h)  # what the embedding stage trains besides the units (a vision tower)
        # the order the next forward needs them (layer 0 first)
        p.loader.ready.update(p.optimizer.submit(p.params.order(), h, self.grad_ready))

    def released_step(
        self, mbs: list[MicroBatch], lr: float, tokens: int | None
    ) -> tuple[float, int, float, dict[str, float], bool]:
        """A release step (engine.release): (loss, divisor, grad norm, stats, skipped). With
        optim.grad_clip > 0 a measuring pass first gives the clip scale (a non-finite norm skips
        the step before any update); then the releasing pass. A non-finite gradient found after
        some units were updated stops the run: they cannot be undone."""
        p, o = self.p, self.p.ocfg
        scale = 1.0
        if o.grad_clip > 0:  # norm-first: the updates need the clip scale before they start
            loss, n, norm, stats = self._pass(mbs, tokens, Release(p, None))
            if not (math.isfinite(loss) and math.isfinite(norm)):
                return loss, n, norm, stats, True
            scale = min(1.0, o.grad_clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_
        h = AdamWHyper(lr, o.betas[0], o.betas[1], o.eps, o.weight_decay, p.adam_step + 1, scale)
        rel = Release(p, h)
        loss, n, norm, stats = self._pass(mbs, tokens, rel)
        if math.isfinite(loss) and math.isfinite(norm):
            p.embedding.update(h)  # what the embedding stage trains besides the units (a vision tower)
            p.adam_step += 1
            return loss, n, norm, stats, False
        rel.refuse()
        p.optimizer.wait()
        if p.reduce.sum_vector(torch.tensor([float(len(rel.applied))], dtype=torch.float64))[0] > 0:
            k = len(rel.applied)
            raise HorizonError(
                f"optimizer step {p.adam_step + 1}: a non-finite gradient ({rel.refused}) after "
                f"{k} unit{'s were' if k != 1 else ' was'} already updated inside the backward "
                "(optim.grad_release with optim.grad_clip 0 cannot skip such a step whole); no checkpoint "
                "of this state is written (an earlier one stays as it was). Run again with "
                "optim.grad_release: false (free at a resume) or optim.grad_clip > 0 (at a resume with "
                "train.accept_changes: [optim.grad_clip]): both skip such a step whole"
            )
        return loss, n, norm, stats, True  # refused before any update: skipped whole

    def _pass(
        self, mbs: list[MicroBatch], tokens: int | None, release: Release
    ) -> tuple[float, int, float, dict[str, float]]:
        """forward_backward with `release` told each whole gradient: (loss, divisor, norm, stats)."""
        self.release = release
        try:
            loss_sum, n, sq, stats = self.forward_backward(mbs, tokens)
        finally:
            self.release = NoRelease()
        loss = loss_sum / n if n else float("nan")
        return loss, n, math.sqrt(sq) if sq >= 0 else float("nan"), stats

    def _passes(self, saved: list[Promise], total: int) -> list[LayerPass]:
        """Per call its pass: the recomputed calls save their inputs, the last K are kept."""
        p = self.p
        save = SavePass(p, self.ckpt, saved, total, self.mb_base)
        kept = KeptPass(p, self.kept, self.mb_base)
        return [save] * self.recomputed + [kept] * p.keep

    # -- head and backward -------------------------------------------------------------------
    def _head(
        self, x: list[torch.Tensor], targets: list[Targets], inv_n: float, sq: list[torch.Tensor]
    ) -> HeadOut:
        p = self.p
        head = self.sweep.acquire_head()
        p.head.bind(head)
        with p.t.compute_span("head"):
            out = p.objective.train(head, x, targets, inv_n)
        self.sweep.release_head()
        self.release.loss = out.loss_sum
        n = len(sq)
        p.head.send(self.grad_ready, sq, self.release.chunks)
        if "head" in self.grad_ready:
            self.release.unit("head", self.grad_ready["head"], sq[n:])
        return out

    def _backward_layers(
        self, dx: list[torch.Tensor], ctxs: list[Context], sq: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        p = self.p
        calls = p.tmpl.calls  # call j runs layer calls[j] (arch.calls; without a loop j is i)
        latest = {i: j for j, i in enumerate(calls)}  # a unit's first call in the backward
        earliest = {i: j for j, i in reversed(list(enumerate(calls)))}  # ... and its last
        for j in reversed(range(len(calls))):
            i = calls[j]
            unit = p.params.trained[i]  # the unit whose gradient this layer produces (None: no adapters)
            k = j % 2
            p.tmpl.add_side_grads(j, dx, ctxs)  # a loop's junctions read this call's output too
            if latest[i] == earliest[i]:
                g, gv = p.grads.buffer(unit, k)
            else:  # called more than once: its calls' gradients add up in a buffer of its own
                g, gv = p.grads.loop_buffer(unit, fresh=j == latest[i])
            self.passes[j].backward(j, dx, ctxs, gv)  # recompute from the saved input, or the kept graph
            if unit is not None and g is not None and j == earliest[i]:  # its last call: the sum is whole
                n = len(sq)
                if nan_grad(unit, p.adam_step + 1):  # a fault-injection test's (faults.py)
                    g.view(-1)[0] = float("nan")
                ev = p.reduce.layer(unit, g, k, sq, self.release.chunks)
                p.grads.free[k] = self.grad_ready[unit] = ev
                if latest[i] != earliest[i]:
                    p.grads.loop_free[unit] = ev
                self.release.unit(unit, ev, sq[n:])
                mark("layer-grad", p.adam_step + 1)  # a crash test's point inside the backward (faults.py)
        return dx

    # -- buffers -----------------------------------------------------------------------------
    def _ensure_ckpt(self, total: int) -> None:
        """Host buffers for each layer's saved inputs: sized once from max_tokens, else grow-only."""
        p = self.p
        if self.ckpt and self.ckpt[0].numel() >= total:
            return
        for old in self.ckpt:
            p.t.host_release(old)
        self.ckpt = [p.t.host_empty(total, p.dtype) for _ in range(self.recomputed)]  # kept: none

    def _account(self, shapes: list[tuple[int, ...]]) -> None:
        """Device memory by category for this step's shapes (the CPU has no allocator to ask)."""
        p = self.p
        item = p.dtype.itemsize
        acts = sum(math.prod(sh) for sh in shapes) * p.spec.boundary_width * item
        lent = p.loader.lend  # saved inputs are read where they lie
        p.t.memory.set("ckpt", 0 if lent else p.loader.extra_bytes() or acts * len(p.loader.ring))
        p.t.memory.set("activations", 2 * acts)
        rows, T = max(sh[0] for sh in shapes), max(sh[1] for sh in shapes)
        tok = max(sh[0] * sh[1] for sh in shapes)
        tile = p.tmpl.seq_tile  # engine.seq_tile (model.tiling)
        work = layer_work_bytes(p.spec, tok, rows, T, item, tile) + p.params.work_bytes(tok, item)
        p.t.memory.set("layer_work", work)
        p.t.memory.set("backward transients", p.params.transient_bytes(tok, item, tile))
        p.t.memory.set("head_work", head_work_bytes(p.spec, tok, p.cfg.loss_chunk, item))
        if p.keep:  # each kept layer's graphs of every micro-batch (planning.memory.kept_graph_bytes)
            graphs = sum(
                kept_graph_bytes(p.spec, sh[0] * sh[1], sh[0], sh[1], item, self.vectors, tile)
                + p.params.kept_bytes(sh[0] * sh[1], item)
                for sh in shapes
            )
            p.t.memory.set("kept graphs", p.keep * graphs)
