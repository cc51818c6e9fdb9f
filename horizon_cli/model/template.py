"""The layer template the schedule runs: one object per architecture, chosen from the store.

  native   model.layer's functional decoder layer (Llama, Mistral, Qwen2, Qwen3): RoPE tables and
           masks from model.masks, RMSNorm head, plain logits
  generic  transformers' own decoder-layer modules (model.generic), for every other family

The schedule calls the same methods on either (per micro-batch `context`; per layer `forward` and,
in the backward recompute, `objective`, which may add a per-layer auxiliary term, both with the
layer's LoRA adapters when there are; for a kept layer, whose forward's graph serves its backward,
`forward_held` under autograd and, in the backward, `held_objective` for the auxiliary term (natively passed down to each linear layer, on the generic
path applied by forward hooks on transformers' linear modules); the head's
`final_norm` and `logits`; the step hooks `begin_step` / `end_forward` / `step_stats`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..arch import ArchSpec
from ..data.batch import DecodeBatch, MicroBatch
from .layer import AttnContext, Lora, inv_freq, layer_forward, rms_norm
from .masks import attn_context, cached_context

if TYPE_CHECKING:
    from .generic import GenericTemplate


class NativeTemplate:
    embed_scale: float | None = None
    dropout_on = False  # a run trains with the attention's dropout (engine.dropout sets it)

    def __init__(self, spec: ArchSpec, device: torch.device):
        self.spec = spec
        self.inv = inv_freq(spec).to(device)
        self.calls = list(range(spec.n_layers))  # the layer of each call: every layer once, in order
        self.seq_tile = 0  # tokens per tile of each layer's MLP block (engine.seq_tile; 0: untiled)
        self.stochastic = spec.attn_dropout > 0  # the only dropout of the native layer
        self._drop = 0.0  # the attention dropout of the call being computed (train mode only)

    def train_mode(self, on: bool, call: int) -> None:
        """Inside a training call's dropout scope (engine.dropout): the attention drops."""
        self._drop = self.spec.attn_dropout if on else 0.0

    def context(self, mb: MicroBatch, dtype: torch.dtype, device) -> AttnContext:
        # flex_attention has no dropout: a dropping run's masks are dense ones; tiled: their rules
        fused = False if self.dropout_on else None
        rows = 0 < self.seq_tile < mb.input_ids.numel()  # the layers run it tiled (model.layer)
        return attn_context(mb, self.spec, self.inv, dtype, device, fused, rows=rows)

    def forward(self, i: int, w, x: torch.Tensor, ctx: AttnContext, lora: Lora = None) -> torch.Tensor:
        return layer_forward(
            w, x, ctx, self.spec, self.spec.windows[i], lora, i, self.seq_tile, dropout=self._drop
        )

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
        self, i: int, w, x: torch.Tensor, ctx: AttnContext, lora: Lora = None
    ) -> tuple[torch.Tensor, None]:
        """The backward's recompute (its output is only differentiated: a tiled block is deferred)."""
        spec = self.spec
        return layer_forward(w, x, ctx, spec, spec.windows[i], lora, i, self.seq_tile, True, self._drop), None

    def forward_held(
        self, i: int, w, x: torch.Tensor, ctx: AttnContext, lora: Lora = None
    ) -> tuple[torch.Tensor, None]:
        return self.forward(i, w, x, ctx, lora), None

    def held_objective(self, held, ctx: AttnContext) -> None:
        return None

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


def make_template(spec: ArchSpec, device: torch.device, lora_targets=None, dtype=torch.float32):
    """lora_targets: per layer, the adapted linear layers (lora.targets.Target), or None; dtype:
    the compute dtype (transformers' model of that dtype builds its buffers in it)."""
    return spec.pick(_native, _generic)(spec, device, lora_targets, dtype)


def _native(
    spec: ArchSpec, device: torch.device, lora_targets: list | None, dtype: torch.dtype
) -> NativeTemplate:
    return NativeTemplate(spec, device)  # neither used: adapters and weights arrive with each call


def _generic(
    spec: ArchSpec, device: torch.device, lora_targets: list | None, dtype: torch.dtype
) -> GenericTemplate:
    from .generic import GenericTemplate  # transformers' modelling code: imported when needed

    return GenericTemplate(spec, device, lora_targets, dtype)
