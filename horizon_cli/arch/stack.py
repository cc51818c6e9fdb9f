"""Where a transformers CausalLM keeps its decoder layers, read off the model on the meta device.

The stack is the repeated module list the model's forward loops over: `model.layers` in most
families, `transformer.h` (GPT-2, BLOOM, Falcon, ...), `gpt_neox.layers`, `backbone.layers` (Mamba),
`model.decoder.layers` (OPT), `model.language_model.layers` (the language model of a multimodal
checkpoint). Rules, in order (docs/census-findings.md measured them on every causal LM):

  1. the module lists whose elements are all `GradientCheckpointingLayer` (every v5 decoder layer
     subclasses it); with several (a vision or audio tower has its own), the one whose length is
     the text config's layer count, outside the towers
  2. the module lists of `_no_split_modules` classes, then of identical classes, of that length

Its *owner* is the module that holds it, whose forward runs the loop (`LlamaModel`, `GPT2Model`,
a composite's text model).
"""

from __future__ import annotations

from torch import nn

from ..errors import InputError

TOWERS = ("vision", "visual", "audio", "image", "speech", "sound", "encoder", "vq", "patch", "mtp", "depth")


def _lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]


def _in_tower(path: str) -> bool:
    return any(t in part.lower() for part in path.split(".") for t in TOWERS)


def text_layers(model: nn.Module) -> int | None:
    cfg = getattr(model, "config").get_text_config()  # noqa: B009 (typed as Tensor | Module)
    for key in ("num_hidden_layers", "n_layer", "n_layers", "num_layers"):
        n = getattr(cfg, key, None)
        if isinstance(n, int):
            return n
    return None


def find_stack(model: nn.Module, where: str) -> str:
    """The decoder stack's path in `model` (a CausalLM on the meta device), or InputError."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    n = text_layers(model)
    lists = _lists(model)
    rules = [
        lambda m: all(isinstance(x, GradientCheckpointingLayer) for x in m),
        lambda m: all(type(x).__name__ in set(getattr(model, "_no_split_modules", None) or ()) for x in m),
        lambda m: len({type(x) for x in m}) == 1 and len(m) == n,
    ]
    for rule in rules:
        found = [(p, m) for p, m in lists if rule(m)]
        if len(found) > 1:
            found = [(p, m) for p, m in found if len(m) == n] or found
        if len(found) > 1:
            found = [(p, m) for p, m in found if not _in_tower(p)] or found
        if len(found) == 1:
            return found[0][0]
        if len(found) > 1:
            names = ", ".join(p for p, _ in found)
            raise InputError(
                f"{where}: several decoder stacks ({names}): not a single decoder the generic path runs"
            )
    raise InputError(f"{where}: no decoder-layer stack found in {type(model).__name__}")


def path_of(model: nn.Module, module: nn.Module | None) -> str | None:
    if module is None:
        return None
    return next((p for p, m in model.named_modules(remove_duplicate=False) if m is module), None)
