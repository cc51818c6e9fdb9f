"""The generic layer template: transformers' own decoder-layer modules, bound to streamed weights.

The CausalLM is built once on the meta device (no memory): its decoder layers are the templates.
At each load, `torch.func.functional_call` runs layer i with the unit's device views in place of
its parameters (and frozen buffers), so the arithmetic is transformers' own, op for op, while the
weights live in the streamed buffer (invariants 1-3 unchanged: the schedule still loads each unit
twice per step and recomputes one layer under autograd).

Around the layers, the pieces the family's model code computes are rebuilt from data
(arch.families, arch.generic): rotary tables from the family's own rotary module (one table, or
one per layer type), attention masks from transformers' mask functions (full / sliding per layer;
packed rows: positions restart per document, which those functions turn into block-diagonal
masks), embedding scale, the family's final-norm module and final-logit soft-capping. Router
outputs are caught with forward hooks on the router modules (the class transformers records as
`router_logits`) and feed model.moe.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call

from ..arch import ArchSpec
from ..arch.generic import hf_config, meta_model
from ..data.batch import DecodeBatch, MicroBatch
from .moe import RouterStats

MASK_KIND = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}


@dataclass
class GenericContext:
    """Per micro-batch: positions, rotary tables per key, masks per kind, real-token mask."""

    pos: torch.Tensor  # (b, T) int64
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # key -> cos, sin (b, T, rotary dim)
    masks: dict[str, torch.Tensor | None]  # kind -> transformers' mask for this attention impl
    tokens: torch.Tensor  # (b*T,) fp32: 1 for real tokens, 0 for padding
    cache: Any = None  # generation: the micro-batch's transformers Cache (DynamicCache)


class _Probed(Exception):
    pass


class _CacheProbe:
    """Stands in for a Cache on the meta device: records what a layer would cache, then stops it."""

    numel = 0

    def update(self, *states, **kw):
        self.numel = sum(s.shape[1] * s.shape[-1] for s in states if isinstance(s, torch.Tensor))
        raise _Probed


def _experts_fallback(model) -> None:
    """transformers' grouped_mm experts need 16-byte strides: an expert matrix whose width is not a
    multiple of 8 elements fails in bf16 ("strides should be multiple of 16 bytes"; transformers'
    own model too). Such models (no released one) run its batched_mm experts: the same arithmetic
    without the grouped GEMM. The layers read config._experts_implementation at call time."""
    cfg = model.config
    if getattr(cfg, "_experts_implementation", None) != "grouped_mm":
        return
    for name, p in model.named_parameters():
        if ".experts." in name and p.dim() == 3 and any(d % 8 for d in p.shape[1:]):
            cfg._experts_implementation = "batched_mm"
            return


class GenericTemplate:
    def __init__(self, spec: ArchSpec, device: torch.device, lora_targets=None):
        g = spec.generic
        assert g is not None
        self.g, self.device = g, device
        self.cfg = hf_config(g["config"], attn=g["attn"])
        model = meta_model(g["config"], g["attn"])
        _experts_fallback(model)
        base = getattr(model, model.base_model_prefix)
        self.layers = list(base.layers)  # meta modules: templates only, never hold weights
        self.norm = base.norm
        self.rotary = None
        if g["rope"] != "none":
            self.rotary = type(base.rotary_emb)(config=self.cfg).to(device)  # buffers only: real
        self.kinds = [self._mask_kind(t) for t in g["layer_types"]]
        self.rope_keys = [t if g["rope"] == "per_layer_type" else "all" for t in g["layer_types"]]
        self.embed_scale: float | None = g["embed_scale"]
        self.softcap: float | None = g["softcap"]
        self.moe = RouterStats(g["moe"]) if g.get("moe") else None
        self._caught: dict[int, tuple] = {}
        if self.moe is not None:
            self._hook_routers(g["moe"])
        self._lora = None  # the adapters of the layer being computed (model.lora.LayerLora)
        for targets in lora_targets or []:
            for t in targets:
                self._hook_linear(t.layer, t.rel, t.weight)

    def _hook_linear(self, i: int, rel: str, weight: str) -> None:
        """LoRA on transformers' own linear module: a forward hook adds the adapter's output (the
        module runs with the streamed weights through functional_call, the hook stays)."""
        mod = self.layers[i].get_submodule(rel)

        def adapt(_mod, inp, out, weight=weight):
            return out if self._lora is None else self._lora(weight, inp[0], out)

        mod.register_forward_hook(adapt)

    def _mask_kind(self, layer_type: str) -> str:
        masks = self.g["masks"]
        if masks == "causal":
            return "full"
        if masks == "window":
            return "sliding" if self.g["sliding_window"] else "full"
        return MASK_KIND[layer_type]

    def _hook_routers(self, moe: dict) -> None:
        for i in moe["layers"]:
            router = next(m for m in self.layers[i].modules() if type(m).__name__ == moe["router"])

            def catch(_mod, _inp, out, i=i):
                self._caught[i] = out if isinstance(out, tuple) else (out,)

            router.register_forward_hook(catch)

    # -- per micro-batch ---------------------------------------------------------------------
    def context(self, mb: MicroBatch, dtype: torch.dtype, device) -> GenericContext:
        tokens = torch.ones(mb.input_ids.shape, dtype=torch.float32)
        if mb.lengths is not None:
            tokens = (torch.arange(mb.input_ids.shape[1])[None, :] < mb.lengths[:, None]).float()
        return self._context(
            mb.input_ids.shape, mb.position_ids.to(device), None, None, tokens, dtype, device
        )

    def new_cache(self):
        """A micro-batch's KV cache: transformers' DynamicCache for this config (sliding-window
        layers keep only their window, as transformers' generate does)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.cfg)

    def kv_row_numel(self) -> list[tuple[int, int | None]]:
        """Per layer: elements its cache keeps per position of one row, and the most positions it
        keeps (a sliding window; None: all). Read off transformers' own layer on the meta device:
        it runs up to its cache update with one token (no memory, no weights)."""
        out = []
        for i, layer in enumerate(self.layers):
            probe = _CacheProbe()
            x = torch.empty(1, 1, self.cfg.hidden_size, device="meta")
            pos = torch.zeros(1, 1, dtype=torch.int64, device="meta")
            kw: dict[str, object] = {"attention_mask": None, "position_ids": pos, "cache": probe}
            if self.rotary is not None:
                key = self.rope_keys[i]
                kw["position_embeddings"] = self.rotary(x, pos) if key == "all" else self.rotary(x, pos, key)
            with contextlib.suppress(_Probed):
                layer(x, **kw)
            window = self.g["sliding_window"] if self.kinds[i] != "full" else None
            out.append((probe.numel, window))
        return out

    def gen_context(self, db: DecodeBatch, cache, dtype: torch.dtype, device) -> GenericContext:
        """A generation sweep: the masks transformers builds from the 2-D attention mask (left
        padding) and the cache's sizes, positions as its generate derives them."""
        att = db.attention_mask()
        tokens = att[:, db.past :].float()
        return self._context(db.input_ids.shape, db.position_ids.to(device), att.to(device), cache, tokens,
                             dtype, device)  # fmt: skip

    def _context(self, shape, pos, att, cache, tokens, dtype, device) -> GenericContext:
        from transformers.masking_utils import (
            create_causal_mask,
            create_chunked_causal_mask,
            create_sliding_window_causal_mask,
        )

        b, T = shape
        like = torch.zeros((), dtype=dtype, device=device).expand(b, T, 1)  # shape, dtype, device only
        fns = {
            "full": create_causal_mask,
            "sliding": create_sliding_window_causal_mask,
            "chunked": create_chunked_causal_mask,
        }
        masks = {
            k: fns[k](config=self.cfg, inputs_embeds=like, attention_mask=att, cache=cache, position_ids=pos)
            for k in set(self.kinds)
        }
        rope = {}
        if self.rotary is not None:
            for key in set(self.rope_keys):
                args = (like, pos) if key == "all" else (like, pos, key)
                rope[key] = self.rotary(*args)
        return GenericContext(pos, rope, masks, tokens.reshape(-1).to(device), cache)

    # -- layers ------------------------------------------------------------------------------
    def _call(
        self, i: int, w: dict[str, torch.Tensor], x: torch.Tensor, ctx: GenericContext, lora=None
    ) -> torch.Tensor:
        kw: dict[str, object] = {"attention_mask": ctx.masks[self.kinds[i]], "position_ids": ctx.pos}
        if self.rotary is not None:
            kw["position_embeddings"] = ctx.rope[self.rope_keys[i]]
        if ctx.cache is not None:
            kw["cache"] = ctx.cache
        self._lora = lora
        try:
            out = functional_call(self.layers[i], w, (x,), kw, strict=True)
        finally:
            self._lora = None
        return out[0] if isinstance(out, tuple) else out

    def forward(self, i: int, w, x: torch.Tensor, ctx: GenericContext, lora=None) -> torch.Tensor:
        """x (b, T, H) -> (b, T, H); records router statistics."""
        return self.forward_held(i, w, x, ctx, lora)[0]

    def forward_held(
        self, i: int, w, x: torch.Tensor, ctx: GenericContext, lora=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and what a kept layer's backward needs for its share of the auxiliary loss
        (the router logits, with their graph when run under autograd; None for a dense layer)."""
        y = self._call(i, w, x, ctx, lora)
        if self.moe is None or i not in self._caught:
            return y, None
        out = self._caught.pop(i)
        chosen = out[-1] if len(out) > 1 and not out[-1].is_floating_point() else None
        logits = out[self.g["moe"]["logits_index"]]
        self.moe.record(i, logits, chosen, ctx.tokens)
        return y, logits

    def held_objective(self, held: torch.Tensor | None, ctx: GenericContext) -> torch.Tensor | None:
        """A kept layer's backward: the scalar `objective` adds (every layer's routing is known now),
        from the router logits its forward held."""
        return None if self.moe is None or held is None else self.moe.objective(held, ctx.tokens)

    def objective(
        self, i: int, w, x: torch.Tensor, ctx: GenericContext, lora=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Recompute under autograd: (output, extra scalar whose gradient is this layer's share of
        the auxiliary loss, or None)."""
        y = self._call(i, w, x, ctx, lora)
        if self.moe is None or i not in self._caught:
            return y, None
        out = self._caught.pop(i)
        return y, self.moe.objective(out[self.g["moe"]["logits_index"]], ctx.tokens)

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
    def final_norm(self, h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """The family's own final norm module (e.g. Gemma's (1 + w) RMSNorm)."""
        return functional_call(self.norm, {k[len("norm.") :]: v for k, v in w.items()}, (h,), strict=True)

    def logits(self, x: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
        """(n, H) -> (n, V) in the compute dtype, soft-capped as the family's ForCausalLM does."""
        out = F.linear(x, lm)
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out
