"""Per micro-batch attention context: RoPE tables and the masks each window size needs."""

from __future__ import annotations

import torch

from ..arch import ArchSpec
from ..data.batch import MicroBatch
from .layer import AttnContext, rope_tables


def attn_context(
    mb: MicroBatch, spec: ArchSpec, inv: torch.Tensor, dtype: torch.dtype, device
) -> AttnContext:
    pos = mb.position_ids.to(device, non_blocking=True)
    cos, sin = rope_tables(inv, pos, dtype)
    b, T = mb.input_ids.shape
    doc = mb.doc_ids.to(device, non_blocking=True) if mb.doc_ids is not None else None
    masks: dict[int | None, torch.Tensor | None] = {}
    for window in set(spec.windows):
        if doc is None and (window is None or window >= T):
            masks[window] = None  # plain causal attention is exact: SDPA's fused causal path
            continue
        i = torch.arange(T, device=device)[:, None]
        j = torch.arange(T, device=device)[None, :]
        m = j <= i  # (T, T) causal
        if window is not None:
            m = m & (i - j < window)  # transformers: kv_idx > q_idx - window
        m = m[None, None]  # (1, 1, T, T)
        if doc is not None:  # packed rows: attend only inside one's own document
            m = m & (doc[:, None, :, None] == doc[:, None, None, :])
        masks[window] = m.expand(b, 1, T, T)
    return AttnContext(cos, sin, masks)
