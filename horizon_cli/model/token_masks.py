"""The generic path's owner inputs for a batch with images (model.generic), and the attention
masks a model builds from token types: Gemma 3's bidirectional attention within each
image's block of tokens (causal everywhere else), for the generic path's owner (model.generic).

The stack's owner (Gemma3TextModel) builds plain causal / sliding-window masks; the bidirectional
overlay is built one level up, by the multimodal model, from `token_type_ids`. horizon calls the
checkpoint class's own hook for it, `create_masks_for_generate(config, inputs_embeds,
attention_mask, cache, position_ids, token_type_ids, is_first_iteration)` — what transformers'
generate calls, and, for Gemma 3, the same `create_masks_for_vision_model` its forward calls:

    full_attention      causal OR (query and key in the same image block)
    sliding_attention   (causal OR same block) AND within the sliding window

and hands the owner that mapping as its `attention_mask` (the owner takes a ready mapping as
given), so the mask of each layer's type reaches every streamed layer among the arguments the
owner passes it (recorded by the first layer's capture, reused by the backward recompute).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def reads_token_types(model) -> bool:
    """The class's own mask hook takes token types (so horizon can build what its forward builds)."""
    hook = getattr(type(model), "create_masks_for_generate", None)
    return hook is not None and "token_type_ids" in inspect.signature(hook).parameters


def token_type_masks(
    model,
    rows: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Any,
    position_ids: torch.Tensor,
    token_types: torch.Tensor,
) -> dict[str, torch.Tensor | None]:
    """The owner's attention-mask mapping (layer type -> (b, 1, T, S) mask, or None) for a batch
    with token types. rows: (b, T, H) the owner's input (only its shape, dtype and device are
    read); attention_mask: (b, S) real tokens, or None (training: right padding, never attended
    by a real token); cache: a generation's, or None; token_types: (b, T), 1 on image tokens."""
    masks = type(model).create_masks_for_generate(
        config=model.config,
        inputs_embeds=rows,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
        token_type_ids=token_types.to(rows.device),
        is_first_iteration=True,
    )
    if not isinstance(masks, dict):
        raise RuntimeError(f"{type(model).__name__}.create_masks_for_generate gave no mask per layer type")
    return masks


def has_media(batch) -> bool:
    """A micro-batch (or a prefill) with images: its rows come from the image stage (vision.embed)."""
    media = getattr(batch, "media", None)
    return media is not None and any(v.numel() for v in media.values())


def owner_inputs(kw: dict[str, Any], model, rows: torch.Tensor, ctx) -> dict[str, Any]:
    """The owner's inputs `kw` for a context (model.generic_context.GenericContext): rows with images merged
    are given as `inputs_embeds`, as a multimodal forward gives its language model (they are the
    embedding module's output already: Gemma 3 scales before it merges); with token types, the
    mask mapping is its attention mask."""
    if ctx.embedded:
        kw = {k: v for k, v in kw.items() if k != "input_ids"} | {"inputs_embeds": rows}
    if ctx.types is None:
        return kw
    return {**kw, "attention_mask": token_type_masks(model, rows, ctx.att, ctx.cache, ctx.pos, ctx.types)}
