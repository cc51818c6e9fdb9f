"""The layer template the schedule runs: one object per architecture, chosen from the store.

  native   model.layer's functional decoder layer (Llama, Mistral, Qwen2, Qwen3): RoPE tables and
           masks from model.masks, RMSNorm head, plain logits
  generic  transformers' own decoder-layer modules (model.generic), for every other family

The schedule calls the same methods on either (per micro-batch `context`; per layer `forward` and,
in the backward recompute, `objective`, which may add a per-layer auxiliary term, both handed the
call as a value (model.call.LayerCall: the call, its micro-batch and step, train or eval, its
tile, the layer's LoRA adapters when there are); for a kept layer, whose forward's graph serves its backward,
`forward_held` under autograd and, in the backward, `held_objective` for the auxiliary term (natively passed down to each linear layer, on the generic
path applied by forward hooks on transformers' linear modules); the head's
`final_norm` and `logits`; the step hooks `begin_step` / `end_forward` / `step_stats`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..arch import ArchSpec
from ..data.batch import DecodeBatch, MicroBatch
from .call import LayerCall
from .layer import AttnContext, Weights, inv_freq, layer_forward, rms_norm
from .masks import attn_context, cached_context

if TYPE_CHECKING:
    from .generic import GenericTemplate


class NativeTemplate:
    embed_scale: float | None = None
    dropout_on = False  # a run trains with the attention's dropout (engine.dropout sets it)

    def __init__(self, spec: ArchSpec, device: torch.device, tile: int = 0) -> None:
        self.spec = spec
        self.inv = inv_freq(spec).to(device)
        self.calls = list(range(spec.n_layers))  # the layer of each call: every layer once, in order
        self.seq_tile = tile  # tokens per tile of each layer (engine.seq_tile; 0: untiled)
        self.stochastic = spec.attn_dropout > 0  # the only dropout of the native layer

    def train_mode(self, on: bool, call: int) -> None:
        """Nothing to switch: a training call's attention drops by its LayerCall (`dropout`)."""

    def context(self, mb: MicroBatch, dtype: torch.dtype, device) -> AttnContext:
        # flex_attention has no dropout: a dropping run's masks are dense ones; tiled: their rules
        fused = False if self.dropout_on else None
        rows = 0 < self.seq_tile < mb.input_ids.numel()  # the layers run it tiled (model.layer)
        return attn_context(mb, self.spec, self.inv, dtype, device, fused, rows=rows)

    def forward(self, w: Weights, x: torch.Tensor, ctx: AttnContext, call: LayerCall) -> torch.Tensor:
        return layer_forward(w, x, ctx, self.spec, self.spec.windows[call.layer], call)

    # -- generation --------------------------------------------------------------------------
    def new_cache(self):
        """A micro-batch's KV cache: transformers' DynamicCache, one plain layer per decoder layer
        (K/V of every position; windows are applied by the masks)."""
        from transformers import DynamicCache

        return DynamicCache()

    def kv_row_numel(self) -> list[tuple[int, int | None]]:
        """Per layer: cached elements per position of one row (K and V), most positions kept."""
        return [(2 * self.spec.kv_dim, None)] * self.spec.n_layers

    def gen_context(self, db: DecodeBatch, cache, dtype: torch.dtype, device) -> AttnContext:
        return cached_context(db, self.spec, self.inv, dtype, device, cache)

    def objective(
        self, w: Weights, x: torch.Tensor, ctx: AttnContext, call: LayerCall
    ) -> tuple[torch.Tensor, None]:
        """The backward's recompute (its output is only differentiated: a tiled block is deferred)."""
        return layer_forward(w, x, ctx, self.spec, self.spec.windows[call.layer], call.recompute()), None

    def forward_held(
        self, w: Weights, x: torch.Tensor, ctx: AttnContext, call: LayerCall
    ) -> tuple[torch.Tensor, None]:
        return self.forward(w, x, ctx, call), None

    def held_objective(self, held, ctx: AttnContext) -> None:
        return None

    def across_ranks(self, all_sum: Callable[[torch.Tensor], None]) -> None:
        pass  # no statistic of the global batch (no router)

    def add_side_grads(self, j: int, dx: list[torch.Tensor], ctxs: list) -> None:
        pass  # no loop (arch.calls): nothing reaches a layer's output but the next layer's gradient

    def side_inputs(self, i: int, ctx: AttnContext) -> list[torch.Tensor]:
        return []  # nothing crosses the native layers but the hidden state

    def side_grads(self, i: int, ctx: AttnContext, grads) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def end_forward(self) -> None:
        pass

    def step_stats(self) -> tuple[float | None, list[float]]:
        return None, []

    def head_tensors(self, w: dict[str, torch.Tensor], embed: torch.Tensor | None):
        """The head unit's tensors (weights or gradients) as the head computes with them: (the
        final norm's, the LM head's (V, H) — the embedding's when tied)."""
        return {"norm": w["norm"]}, (embed if embed is not None else w["lm_head"])

    def final_norm(self, h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        return rms_norm(h, w["norm"], self.spec.rms_eps)

    def logits(self, x: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
        return F.linear(x, lm)


def make_template(
    spec: ArchSpec, device: torch.device, lora_targets=None, dtype=torch.float32, tile: int = 0
):
    """lora_targets: per layer, the adapted linear layers (lora.targets.Target), or None; dtype:
    the compute dtype (transformers' model of that dtype builds its buffers in it); tile: tokens
    per tile of each layer's token-local parts (engine.seq_tile; 0: untiled)."""
    return spec.pick(_native, _generic)(spec, device, lora_targets, dtype, tile)


def _native(
    spec: ArchSpec, device: torch.device, lora_targets: list | None, dtype: torch.dtype, tile: int
) -> NativeTemplate:
    return NativeTemplate(spec, device, tile)  # adapters and weights arrive with each call


def _generic(
    spec: ArchSpec, device: torch.device, lora_targets: list | None, dtype: torch.dtype, tile: int
) -> GenericTemplate:
    from .generic import GenericTemplate  # transformers' modelling code: imported when needed

    return GenericTemplate(spec, device, lora_targets, dtype, tile)
