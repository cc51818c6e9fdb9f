"""Which parts of a transformers decoder layer are token-local (engine.seq_tile tiles them).

Read off the module structure, never a family's name: a direct child of the layer is its
token-local block (the MLP, the MoE block, a feed-forward, whichever attribute holds it) when

  * its forward takes one argument (the hidden states) and nothing else: attention and
    recurrent mixers take masks, positions or a cache besides, so they are never chosen;
  * it holds a weight of two or more dimensions (a norm holds only vectors);
  * nothing inside it convolves over positions (an nn.Conv* module: a short convolution mixes
    neighbouring tokens).

Such a block computes each token from that token alone (a row-wise MLP, a router and the experts
it picks per token), so model.tiling runs it on any slice of the tokens. A layer with no such child
runs untiled; `horizon inspect` and `--dry-run` say which layer kinds those are.
"""

from __future__ import annotations

import inspect

from torch import nn

from .generic_arch import GenericArch

# id(GenericArch) -> (it, per kind its blocks): the description held, so its id is never reused
_found: dict[int, tuple[GenericArch, dict[str, tuple[str, ...]]]] = {}


def _one_argument(mod: nn.Module) -> bool:
    try:
        params = list(inspect.signature(mod.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


def is_token_local(mod: nn.Module) -> bool:
    """The structural rule of the module doc, for one child of a decoder layer."""
    if not _one_argument(mod):
        return False
    if any(isinstance(m, nn.modules.conv._ConvNd) for m in mod.modules()):
        return False
    return any(p.dim() >= 2 for p in mod.parameters())


def token_local(layer: nn.Module) -> tuple[str, ...]:
    """The attribute names of a decoder layer's token-local blocks (usually one: its MLP or MoE)."""
    return tuple(name for name, child in layer.named_children() if is_token_local(child))


def blocks(g: GenericArch) -> dict[str, tuple[str, ...]]:
    """Per layer kind of the model: its token-local blocks (empty: the kind runs untiled). Built on
    the meta device from the store's config (no memory), once per description."""
    key = id(g)
    if key not in _found:
        _found[key] = (g, _read(g))
    return _found[key][1]


def _read(g: GenericArch) -> dict[str, tuple[str, ...]]:
    from .generic import stored_model
    from .probe import probe

    out: dict[str, tuple[str, ...]] = {k: () for k in g.layer_kinds}
    try:
        model = stored_model(g)
        s = g.model if g.model is not None else probe(model, "the store's config.json")
        layers = list(model.get_submodule(s.stack))
    except Exception:  # noqa: BLE001 (a model the meta device cannot build: every kind untiled, said so)
        return out
    seen: set[str] = set()
    for i, kind in enumerate(g.layer_kinds):
        if kind not in seen and i < len(layers):
            out[kind] = token_local(layers[i])
            seen.add(kind)
    return out


def untiled_kinds(g: GenericArch) -> list[str]:
    """The layer kinds with no token-local block found (they run untiled)."""
    return [k for k, found in blocks(g).items() if not found]


def note(g: GenericArch) -> str:
    """What engine.seq_tile tiles in each layer of this generic model, in words (inspect, --dry-run;
    a native model's: planning.tiling.note)."""
    found = blocks(g)
    by: dict[tuple[str, ...], list[str]] = {}
    for kind, paths in found.items():
        by.setdefault(paths, []).append(kind)
    parts = [
        (
            f"{', '.join(p)} of layer kind(s) {', '.join(k)}"
            if p
            else f"nothing in layer kind(s) {', '.join(k)} (untiled: no token-local block found)"
        )
        for p, k in by.items()
    ]
    return "; ".join(parts)


def block_prefixes(g: GenericArch, i: int) -> tuple[str, ...]:
    """Module paths (with a trailing dot) of layer i's token-local blocks."""
    return tuple(f"{b}." for b in blocks(g).get(g.layer_kinds[i], ()))
