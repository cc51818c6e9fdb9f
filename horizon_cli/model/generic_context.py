"""A generic layer template's per-micro-batch context (model.generic): the owner's inputs, the
real-token mask, and what the layers record and pass along during a step or a generation sweep."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..data.batch import DecodeBatch, MicroBatch
from .side import SideState
from .token_masks import has_media


@dataclass
class GenericContext:
    """Per micro-batch: the owner's inputs, the real-token mask, and every layer's arguments as
    the owner passed them (filled by the first layer's forward)."""

    ids: torch.Tensor  # (b, T) int64 on the device
    pos: torch.Tensor  # (b, T) int64
    att: torch.Tensor | None  # 2-D attention mask (generation: left padding), or None
    tokens: torch.Tensor  # (b*T,) fp32: 1 for real tokens, 0 for padding
    cache: Any = None  # generation: the micro-batch's transformers Cache (DynamicCache)
    packed: bool = False  # rows hold several documents (positions restart at each)
    types: torch.Tensor | None = None  # (b, T) token types the model's masks read (model.token_masks)
    embedded: bool = False  # the rows are the embedding module's output (images merged: model.token_masks)
    calls: dict[int, tuple[tuple, dict]] | None = None
    carry: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # layer -> its passed outputs
    # a loop (arch.calls): the outputs of calls a later junction reads, and their gradients so far
    outs: dict[int, torch.Tensor] = field(default_factory=dict)
    sinks: dict[int, torch.Tensor] = field(default_factory=dict)
    side: SideState = field(default_factory=SideState)  # tensors crossing layers with a gradient


def train_context(mb: MicroBatch, device: torch.device) -> GenericContext:
    """A training or evaluation micro-batch's context (no attention mask: the owner builds it)."""
    tokens = torch.ones(mb.input_ids.shape, dtype=torch.float32)
    if mb.lengths is not None:
        tokens = (torch.arange(mb.input_ids.shape[1])[None, :] < mb.lengths[:, None]).float()
    return GenericContext(
        mb.input_ids.to(device),
        mb.position_ids.to(device),
        None,
        tokens.reshape(-1).to(device),
        packed=mb.doc_ids is not None,
        types=mb.token_types,
        embedded=has_media(mb),
    )


def generation_context(db: DecodeBatch, cache: object, device: torch.device) -> GenericContext:
    """A generation sweep: the 2-D attention mask (left padding) and the cache go to the owner,
    which builds the masks from them as in transformers' generate; positions as it derives them."""
    att, ids, pos = db.attention_mask().to(device), db.input_ids.to(device), db.position_ids.to(device)
    tokens = att[:, db.past :].float().reshape(-1)
    return GenericContext(ids, pos, att, tokens, cache, types=db.token_types, embedded=has_media(db))


def forward_inputs(ctx: GenericContext, names: tuple[str, ...], cache: bool = True) -> dict[str, Any]:
    """The keyword inputs of the owner's forward (`names`: those it takes) for a context; a
    junction's re-run (cache False) passes neither the mask nor the cache."""
    kw: dict[str, Any] = {"input_ids": ctx.ids}
    if "position_ids" in names:
        kw["position_ids"] = ctx.pos
    if ctx.att is not None and cache:  # a junction's re-run (no cache) builds no mask it reads
        kw["attention_mask"] = ctx.att
    if ctx.cache is not None and cache:
        kw["cache" if "cache" in names else "past_key_values"] = ctx.cache
        kw["use_cache"] = True
    elif "use_cache" in names:
        kw["use_cache"] = False
    return kw
