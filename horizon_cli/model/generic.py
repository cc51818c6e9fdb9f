"""The generic layer template: transformers' own model code, bound to streamed weights.

The model is built once on the meta device (no memory): its decoder layers are the templates. At each
load `torch.func.functional_call` runs layer i with the unit's device views in place of its parameters
(and frozen buffers): transformers' arithmetic, op for op, on weights in the streamed buffer (invariants
1-3 unchanged: each unit loads twice per step, the backward recomputes one layer under autograd).

Around the layers runs transformers' own code too (arch.capture, structure from arch.probe):

  first layer  before it, the stack's owner runs its forward on the micro-batch's rows (gathered on
               the host) with recorders for layers: embedding scales and multipliers, learned
               positions, embedding norms, rotary tables per layer type, the masks per layer type
               from transformers' mask functions (packed rows: positions restart per document,
               which they turn into block-diagonal masks), ALiBi — every layer's arguments are
               recorded into the micro-batch's context, and the first layer's input carries the
               graph back to the rows and to the model-level tensors its unit holds, so the
               backward recompute of that layer differentiates all of it
  layers       each with the arguments the owner gave it and the running hidden state; a layer
               the owner does not call (Mllama's cross-attention without images) passes through
  head         the owner's modules after its last layer (final norms) per micro-batch, then the
               CausalLM's logits per chunk: its head module, or its whole forward on the chunk's
               rows (`logits: forward`: logit scaling, soft-capping, slicing as it wrote them)

Tensors besides the hidden state that cross layers with a gradient (per-layer inputs, outputs a
layer passes to the next, entries of a dict shared by the layers: Gemma 4's K/V sharing) are side
inputs (model.side): leaves of their consumer, their gradients seeded into their producer's
backward. Router outputs are caught with forward hooks on the router modules (model.moe).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module

from ..arch import ArchSpec
from ..arch.calls import is_loop, sequence
from ..arch.capture import (
    Stop,
    head_stub,
    hidden_of,
    materialize_buffers,
    packed_positions,
    recorders,
    rows_embedding,
    with_hidden,
)
from ..arch.generic import stored_model
from ..arch.generic_arch import GenericArch, Moe
from ..arch.probe import probe
from ..arch.structure import Stack
from ..data.batch import DecodeBatch, MicroBatch
from .call import LayerCall
from .generic_call import CallSlot, tile_blocks
from .generic_context import GenericContext, forward_inputs, generation_context, train_context
from .junction import Junctions
from .layer import Weights
from .moe import RouterStats, experts_fallback
from .side import plus
from .token_masks import owner_inputs
from .train_mode import ModuleTrainMode


def structure(g: GenericArch) -> Stack:
    """The forward's structure (arch.probe) a store recorded; stores written before it carry none
    and are probed from their config once."""
    if g.model is not None:
        return g.model
    return probe(stored_model(g), "the store's config.json")


class GenericTemplate(ModuleTrainMode):  # dropout in training calls (model.train_mode)
    embed_scale: float | None = None  # the owner's own code scales its embedding (first layer)

    def __init__(
        self, spec: ArchSpec, device: torch.device, lora_targets=None, dtype=torch.float32, tile: int = 0
    ):
        g = spec.generic
        assert g is not None
        self.g, self.device, self.s, self.dtype = g, device, structure(g), dtype
        s = self.s
        model = stored_model(g, dtype)  # buffers in the compute dtype, as transformers builds them
        experts_fallback(model)
        self.model, self.cfg = model, model.config.get_text_config()
        self.owner = model.get_submodule(s.owner)
        self.layers = list(model.get_submodule(s.stack))  # meta modules: templates only
        self.emb = model.get_submodule(s.embed)
        self.head = model.get_submodule(s.head)
        self.suffix = [(p, model.get_submodule(p)) for p in s.suffix]
        self.first, self.last, self.called = s.calls[0], s.calls[-1], set(s.calls)
        # the engine runs one call after another (arch.calls): every layer once, or a loop's calls
        self.calls, self.loop = sequence(s, len(self.layers)), is_loop(s.calls)
        self.start = 0 if self.loop else self.first  # the call that runs the owner's prefix
        self.junctions = Junctions(s, self.owner, self.emb, self.layers)
        self._side: dict[int, list[tuple[str, Any]]] = {}  # layer -> its recorded side arguments
        for c in s.side:
            self._side.setdefault(c.at, []).append((c.how, c.key))
        outside = [m for n, m in model.named_children() if n != s.base]
        materialize_buffers(model, [*outside, self.owner], device)  # the owner's own, its layers'
        self._buffers = [
            {n: b for n, b in la.named_buffers() if b.device.type != "meta"} for la in self.layers
        ]
        first_kind = g.layer_table(self.first)
        self._ints = {  # a kind's integer buffers, held as floats in the unit (DeepSeek-V4's tid2eid)
            k: {e.name: getattr(torch, e.dtype) for e in rows if e.dtype} for k, rows in g.kinds.items()
        }
        self._prefix = {e.name: e.hf for e in first_kind if e.name.startswith("@")}
        self._head = {e.name: e.hf for e in g.units.head}
        self._head_w = f"{s.head}.weight"
        self.moe = RouterStats(g.moe) if g.moe else None
        self._caught: dict[int, tuple[torch.Tensor, ...]] = {}
        if g.moe is not None:
            self._hook_routers(g.moe)
        self._slot = CallSlot()  # the call being computed, for the modules' hooks (model.generic_call)
        for targets in lora_targets or []:  # LoRA: a hook on each adapted linear module
            for t in targets:
                self._slot.hook(self.layers[t.layer].get_submodule(t.rel), t.weight)
        self.seq_tile = tile  # tokens per tile of the layers' token-local blocks (engine.seq_tile)
        tile_blocks(g, self.layers, tile, self._slot, self._caught)

    def _hook_routers(self, moe: Moe) -> None:
        for i in moe.layers:
            router = next(m for m in self.layers[i].modules() if type(m).__name__ == moe.router)

            def catch(_mod, _inp, out, i=i):
                self._caught[i] = out if isinstance(out, tuple) else (out,)

            router.register_forward_hook(catch)

    # -- per micro-batch ---------------------------------------------------------------------
    def context(self, mb: MicroBatch, dtype: torch.dtype, device) -> GenericContext:
        return train_context(mb, device)

    def gen_context(self, db: DecodeBatch, cache, dtype: torch.dtype, device) -> GenericContext:
        return generation_context(db, cache, device)

    def _owner_inputs(self, ctx: GenericContext, cache: bool = True) -> dict[str, Any]:
        return forward_inputs(ctx, self.s.owner_kwargs, cache)

    def _capture(self, w: dict[str, torch.Tensor], rows: torch.Tensor, ctx: GenericContext) -> dict:
        """Run the owner's forward up to its last layer on `rows` (b, T, H): every layer's call
        (by layer; a loop's by call)."""
        cut = len(self.s.owner) + 1
        pw = {self._prefix[k][cut:]: v for k, v in w.items() if k in self._prefix}
        log: list = []
        stop_at, stop_call = (None, len(self.calls) - 1) if self.loop else (self.last, None)
        with (
            _reparametrize_module(self.owner, pw, strict=False),
            contextlib.nullcontext() if ctx.embedded else rows_embedding(self.emb, rows),
            recorders(self.layers, log, self.s.returns, stop_at=stop_at, stop_call=stop_call),
            packed_positions(self.owner, ctx.pos) if ctx.packed else contextlib.nullcontext(),
            contextlib.suppress(Stop),
        ):
            self.owner(**owner_inputs(self._owner_inputs(ctx), self.model, rows, ctx))
        if self.loop:
            return {j: (args, kwargs) for j, (_, args, kwargs) in enumerate(log)}
        return {i: (args, kwargs) for i, args, kwargs in log}

    def across_ranks(self, all_sum: Callable[[torch.Tensor], None]) -> None:
        if self.moe is not None:  # sharded: the router statistics are the global batch's (model.moe)
            self.moe.reduce = all_sum

    def add_side_grads(self, j: int, dx: list[torch.Tensor], ctxs: list) -> None:
        """Before call j's backward: the gradients a loop's later calls sent its output (arch.calls)."""
        self.junctions.add_side_grads(j, dx, ctxs)

    # -- layers ------------------------------------------------------------------------------
    def _call(self, w: Weights, x: torch.Tensor, ctx: GenericContext, call: LayerCall) -> torch.Tensor:
        """Call j of the sequence (`calls`): layer calls[j] (without a loop, j is the layer)."""
        j, i = call.call, self.calls[call.call]
        if i not in self.called:
            return x  # the owner skips this layer
        grad = torch.is_grad_enabled()
        if grad:
            ctx.side.begin(i)
        if j == self.start:
            calls = self._capture(w, x, ctx)  # x: the embedding rows; under autograd in the recompute
            if ctx.calls is None:
                ctx.calls = calls
            if grad and self._side:
                ctx.side.live_calls = calls  # the recorded side arguments' producer
            args, kwargs = calls[j]
            x = hidden_of(args, kwargs)
        else:
            assert ctx.calls is not None, "the first layer's forward records every layer's arguments"
            args, kwargs = ctx.calls[j]
            if j in self.junctions:
                x = self.junctions.run(j, x, ctx, self._owner_inputs(ctx, cache=False))
            if grad and i in self._side:  # no loop (refused at convert with side inputs): j is i
                args, kwargs = ctx.side.recorded(i, self._side[i], args, kwargs)
        args, kwargs = self._passed_in(i, *with_hidden(args, kwargs, x), ctx)
        kwargs, shared = ctx.side.shared_in(i, kwargs)  # Gemma 4's shared_kv_states
        lw = {k: v for k, v in w.items() if not k.startswith("@")}
        for k, dt in self._ints[self.g.layer_kinds[i]].items():
            lw[k] = lw[k].to(dt)
        with self._slot.bound(call):
            out = functional_call(self.layers[i], {**self._buffers[i], **lw}, args, kwargs, strict=True)
        ctx.side.shared_out(i, shared)
        if isinstance(out, (tuple, list)):
            self._passed_out(i, out, ctx)
            out = out[0]
        out = out.to(self.dtype)  # the boundary in the compute dtype (Zaya's residual stream is fp32)
        if j in self.junctions.held and j not in ctx.outs:  # the forward's: a later junction reads it
            ctx.outs[j] = out.detach()
        return out

    def _passed_in(self, i: int, args: tuple, kwargs: dict, ctx: GenericContext) -> tuple[tuple, dict]:
        """The outputs the previous layer passed on (GLM-MoE-DSA's `prev_topk_indices`), as the
        forward sweep computed them (the backward recompute reads the same values)."""
        calls = self.s.calls
        at = calls.index(i)
        prev = ctx.carry.get(calls[at - 1]) if at else None
        if not prev:
            return args, kwargs
        new, kwargs = list(args), dict(kwargs)
        for p in self.s.passes:
            if p.at in prev:
                v = prev[p.at]
                if v.is_floating_point() and torch.is_grad_enabled():  # a side input (model.side)
                    v = ctx.side.passed(i, calls[at - 1], p.at, v)
                if p.how == "kw":
                    kwargs[str(p.key)] = v
                else:
                    new[int(p.key)] = v
        return tuple(new), kwargs

    def _passed_out(self, i: int, out, ctx: GenericContext) -> None:
        """Keep what layer i passes to the next one: index tensors, and float tensors whose
        gradient the next layer's backward gives back (model.side)."""
        known = {p.at for p in self.s.passes}
        for k in self.s.forwarded:
            v = out[k]
            if v is None:
                continue
            if k not in known or not isinstance(v, torch.Tensor):
                raise RuntimeError(
                    f"layer {i} returns a {type(v).__name__} its model uses (output {k}) other than as the "
                    "next layer's argument: not supported"
                )
            ctx.carry.setdefault(i, {})[k] = v.detach()
            ctx.side.produced(i, k, v)

    def forward(self, w: Weights, x: torch.Tensor, ctx: GenericContext, call: LayerCall) -> torch.Tensor:
        """x (b, T, H) -> (b, T, H) (the first layer: x is the embedding rows); records router statistics."""
        return self.forward_held(w, x, ctx, call)[0]

    def forward_held(
        self, w: Weights, x: torch.Tensor, ctx: GenericContext, call: LayerCall
    ) -> tuple[torch.Tensor, tuple[int, torch.Tensor | None]]:
        """`forward`, and what a kept layer's backward needs for its share of the auxiliary loss
        and its side inputs' producer term: (i, the router logits, with their graph when run under
        autograd; None for a dense layer)."""
        y = self._call(w, x, ctx, call)
        i = self.calls[call.call]  # the layer (a loop's MoE is refused at convert: one call per layer)
        if self.moe is None or i not in self._caught:
            return y, (i, None)
        out = self._caught.pop(i)
        chosen = out[-1] if len(out) > 1 and not out[-1].is_floating_point() else None
        logits = out[self.moe.logits_index]
        self.moe.record(i, logits, chosen, ctx.tokens)
        return y, (i, logits)

    def held_objective(self, held: tuple, ctx: GenericContext) -> torch.Tensor | None:
        """A kept layer's backward: the scalar `objective` adds (every layer's routing is known now),
        from the router logits its forward held, plus its side inputs' producer term."""
        i, logits = held
        aux = None if self.moe is None or logits is None else self.moe.objective(logits, ctx.tokens)
        return plus(aux, ctx.side.seed(i, i == self.first))

    def side_inputs(self, i: int, ctx: GenericContext) -> list[torch.Tensor]:
        """The leaves layer i's last autograd run made for its side inputs (model.side): the
        engine's backward differentiates them too and gives their gradients to `side_grads`."""
        return ctx.side.inputs(i)

    def side_grads(self, i: int, ctx: GenericContext, grads) -> None:
        ctx.side.give(i, grads)

    def objective(
        self, w: Weights, x: torch.Tensor, ctx: GenericContext, call: LayerCall
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Recompute under autograd: (output, extra scalar whose gradient is this layer's share of
        the auxiliary loss and of its side inputs' consumers' (model.side), or None)."""
        y = self._call(w, x, ctx, call)
        i = self.calls[call.call]
        aux = None
        if self.moe is not None and i in self._caught:
            out = self._caught.pop(i)
            aux = self.moe.objective(out[self.moe.logits_index], ctx.tokens)
        return y, plus(aux, ctx.side.seed(i, i == self.first))

    # -- generation --------------------------------------------------------------------------
    def new_cache(self):
        """A micro-batch's cache: transformers' DynamicCache for this config (sliding-window layers
        keep only their window, recurrent layers their state, as transformers' generate does)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def kv_row_numel(self) -> list[tuple[int, int | None]]:
        """Per layer: elements cached per position of one row, most positions kept (None: all), as
        the config's attention shape says (generation reads the exact sizes off transformers' own
        model, generate.kvprobe, and falls back on these)."""
        c = self.cfg
        heads = int(getattr(c, "num_attention_heads", None) or 1)
        kv = 2 * int(getattr(c, "num_key_value_heads", None) or heads)
        kv *= int(getattr(c, "head_dim", None) or int(getattr(c, "hidden_size", 0) or 0) // heads)
        return [(kv, None)] * len(self.layers)

    # -- step --------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._caught.clear()
        if self.moe is not None:
            self.moe.begin_step()

    def end_forward(self) -> None:
        if self.moe is not None:
            self.moe.end_forward()

    def step_stats(self) -> tuple[float | None, list[float]]:
        return self.moe.result() if self.moe is not None else (None, [])

    # -- head --------------------------------------------------------------------------------
    def head_tensors(self, w: dict[str, torch.Tensor], embed: torch.Tensor | None):
        """The head unit's tensors (weights or their gradients, by name) as the head computes with
        them: (the suffix modules', by name; the logits' by in-memory name: the LM head's weight —
        the embedding's when tied — bias, and whatever else the CausalLM's forward uses)."""
        suffix = tuple(p + "." for p, _ in self.suffix)
        norm = {k: v for k, v in w.items() if self._head.get(k, "").startswith(suffix)}
        lm = {self._head[k]: v for k, v in w.items() if k not in norm}
        if embed is not None:
            lm[self._head_w] = embed
        return norm, lm

    def final_norm(self, h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """The owner's modules after its last layer (final norms: Gemma's (1 + w) RMSNorm, LFM2's
        `embedding_norm`, ...), in the order it calls them."""
        for path, mod in self.suffix:
            cut = len(path) + 1
            mw = {self._head[k][cut:]: v for k, v in w.items() if self._head[k].startswith(path + ".")}
            out = functional_call(mod, mw, (h,), strict=False)
            h = out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", out)
        return h

    def logits(self, x: torch.Tensor, lm: dict[str, torch.Tensor]) -> torch.Tensor:
        """(n, H) -> (n, V) in the compute dtype, as the CausalLM computes them; the rows in it too,
        as in transformers' model of that dtype (Zaya's final norm returns fp32 rows)."""
        x = x.to(self.dtype)
        if self.s.logits == "plain":
            return F.linear(x, lm[self._head_w], lm.get(f"{self.s.head}.bias"))
        h = x[None]
        with _reparametrize_module(self.model, lm, strict=False), head_stub(self.model, self.s.base, h):
            return self.model(inputs_embeds=h).logits[0]
