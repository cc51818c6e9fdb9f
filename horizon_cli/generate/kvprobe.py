"""How much a generation's cache holds per layer, read off transformers' own model on the meta device.

One token of one row runs through a fresh meta copy of the model (no memory, no weights) with a
`DynamicCache` made for its config; what each cache layer then holds says its size: keys and values
per position (a sliding-window layer keeps at most its window), a recurrent layer's conv and
recurrent states once per row whatever the length. `per_layer(tmpl)` is what generation reads: for
the generic template the probe's sizes (its own `kv_row_numel`, the config's uniform shape, when the
probe cannot run), for the native one its own. Used by the generation plan (generate.plan) and the
host-mode buffers (generate.decode). The template knows nothing of this: generation calls the probe
on it.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from ..arch.generic import stored_model
from ..arch.generic_arch import GenericArch
from ..engine.seams import LayerTemplate
from ..model.generic import GenericTemplate

_probed: weakref.WeakKeyDictionary[GenericTemplate, list[tuple[int, int | None]]] = (
    weakref.WeakKeyDictionary()
)


def per_layer(tmpl: LayerTemplate) -> list[tuple[int, int | None]]:
    """Per cache layer: (elements per position of a row, positions kept; None: every one). The
    generic template's are probed once per template (a meta forward)."""
    if not isinstance(tmpl, GenericTemplate):
        return tmpl.kv_row_numel()
    if tmpl not in _probed:
        _probed[tmpl] = cache_sizes(tmpl.g, tmpl.new_cache, tmpl.kv_row_numel())
    return _probed[tmpl]


def _numel(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, dict):
        return sum(_numel(v) for v in x.values())
    return 0


def cache_sizes(
    g: GenericArch, new_cache, fallback: list[tuple[int, int | None]]
) -> list[tuple[int, int | None]]:
    """Per cache layer: (elements per position of a row, positions kept; None: every one);
    `fallback` when the meta forward cannot run (a kernel without a meta implementation)."""
    import inspect

    import transformers.masking_utils as mu

    model = stored_model(g)
    for c in (model.config, model.config.get_text_config()):
        if getattr(c, "_experts_implementation", None) is not None:
            c._experts_implementation = "eager"  # the grouped GEMM has no meta kernel for fp32
    cache = new_cache()
    ids = torch.zeros(1, 1, dtype=torch.long, device="meta")
    real = mu.is_tracing
    mu.is_tracing = lambda *a, **k: True  # the mask functions read no values on the meta device
    try:
        with torch.no_grad(), contextlib.suppress(Exception):
            params = inspect.signature(type(model).forward).parameters
            model(
                input_ids=ids, use_cache=True, **{"cache" if "cache" in params else "past_key_values": cache}
            )
    finally:
        mu.is_tracing = real
    out = []
    for lay in cache.layers:
        keys, values = getattr(lay, "keys", None), getattr(lay, "values", None)
        if isinstance(keys, torch.Tensor) and keys.dim() >= 2:
            per = (keys.numel() + _numel(values)) // max(keys.shape[-2], 1)
            window = getattr(lay, "sliding_window", None)
            out.append((per, int(window) if window else None))
        state = _numel(getattr(lay, "conv_states", None)) + _numel(getattr(lay, "recurrent_states", None))
        if state:
            out.append((state, 1))
    return out or fallback
