"""Per micro-batch attention context: RoPE tables and the mask each window size needs.

No mask when plain causal attention is exact (no packing, no window shorter than T): SDPA's
fused causal path. Otherwise a flex block mask on CUDA and a dense bool mask on the CPU
(engine/attend.py says why).
"""

from __future__ import annotations

import torch

from ..arch import ArchSpec
from ..data.batch import MicroBatch
from .attend import Mask, block_mask, dense_mask
from .layer import AttnContext, rope_tables


def attn_context(
    mb: MicroBatch, spec: ArchSpec, inv: torch.Tensor, dtype: torch.dtype, device, fused: bool | None = None
) -> AttnContext:
    """fused: block masks for flex_attention (default: on CUDA) rather than dense ones."""
    device = torch.device(device)
    fused = device.type == "cuda" if fused is None else fused
    pos = mb.position_ids.to(device, non_blocking=True)
    cos, sin = rope_tables(inv, pos, dtype)
    b, T = mb.input_ids.shape
    doc = mb.doc_ids.to(device, non_blocking=True) if mb.doc_ids is not None else None
    masks: dict[int | None, Mask] = {}
    for window in set(spec.windows):
        if doc is None and (window is None or window >= T):
            masks[window] = None
        else:
            masks[window] = (block_mask if fused else dense_mask)(doc, window, b, T, device)
    return AttnContext(cos, sin, masks)
