"""Which multimodal checkpoints train with images, read off transformers' own classes (built on
the meta device), not a table of families.

The image path needs the module transformers merges images with (the *image owner*: LLaVA's
`LlavaModel`, Mistral 3's, Gemma 3's, Idefics3's, ...) to offer `get_image_features` (tower +
projector) and a merge of its features into the embeddings: `get_placeholder_mask` (where the
features go; horizon scatters them as the forward does) or `inputs_merger` (Idefics3's own merge,
called as it is). Its text forward may need two more things from the images, each built from the
model's own code and reaching every streamed layer:

    rope         an owner with `get_rope_index` (Qwen2-VL, Qwen2.5-VL: multimodal rotary position
                 ids from the image grid) gets its position ids from it per micro-batch
                 (vision.tower.VisionTower.positions): they are the layers' position ids
    token types  a forward that reads `token_type_ids` (Gemma 3: bidirectional attention within each
                 image's block of tokens) whose class's `create_masks_for_generate` takes them: the
                 masks are that hook's (model.token_masks), from the processor's token types (1 on
                 the image tokens; a processor whose token types mean something else is refused at
                 the data, vision.encode)

What is refused, each named:

    no image owner          the class has no get_image_features with a get_placeholder_mask or an
                            inputs_merger (cross-attention image layers: Mllama)
    deepstack               a language model that takes image features inside its layers
                            (Qwen3-VL's deepstack_visual_embeds): not yet carried to the layers
    token_type_ids          a text forward that reads token type ids with no mask hook that takes
                            them: not built
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from ..arch import ArchSpec
from ..arch.generic_arch import GenericArch
from ..errors import InputError
from ..model.token_masks import reads_token_types

# a transformers model or one of its modules: the image owner's methods (get_image_features,
# get_placeholder_mask, get_rope_index, ...) differ by model, and torch types a module's
# attributes as Tensor | Module, so it is not typed further
HFModule = Any

LAYER_INPUTS = ("deepstack_visual_embeds", "visual_pos_masks")  # image features given to the layers


@dataclass(frozen=True)
class ImageOwner:
    cls: str  # the checkpoint's transformers class
    owner: str  # module path of the image owner ("" for the top model)
    lm: str  # the owner's child that holds the decoder stack (its language model)
    towers: tuple[str, ...]  # the owner's other children: tower(s) and projector
    rope: bool = False  # the owner computes multimodal rotary position ids (get_rope_index)
    types: bool = False  # its masks read token types (model.token_masks: Gemma 3's image blocks)


def generic_of(arch: ArchSpec) -> GenericArch:
    """A multimodal model's generic description (only a generic model carries a tower)."""
    kind = arch.kind
    assert isinstance(kind, GenericArch), "a multimodal model is a generic one"
    return kind


def is_multimodal(arch: ArchSpec) -> bool:
    g = arch.generic
    return g is not None and bool(g.carried)


MERGES = ("get_placeholder_mask", "inputs_merger")  # where the features go / the owner's own merge


def find_owner(model: HFModule, stack: str) -> tuple[str, HFModule] | None:
    """(path, module) of the first module with image features and a merge, or None."""
    for path, mod in model.named_modules():
        if hasattr(mod, "get_image_features") and any(hasattr(mod, m) for m in MERGES) and path != stack:
            return path, mod
    return None


def image_owner(arch: ArchSpec, where: str, model: HFModule | None = None) -> ImageOwner:
    """The image owner of a multimodal store's class, or an InputError naming what is missing."""
    from ..arch.generic import stored_model

    g = arch.generic
    assert g is not None and g.model is not None
    model = model if model is not None else stored_model(g)
    name = g.cls or type(model).__name__
    found = find_owner(model, g.model.stack)
    if found is None:
        raise InputError(
            f"{where}: {name} has no get_image_features with a get_placeholder_mask or inputs_merger in "
            "transformers (its images enter otherwise: cross-attention layers), so it trains on text only"
        )
    path, owner = found
    params = inspect.signature(type(owner).forward).parameters
    rope = (
        set(inspect.signature(owner.get_rope_index).parameters) if hasattr(owner, "get_rope_index") else set()
    )
    types = "token_type_ids" in params and "token_type_ids" not in rope
    if types and not reads_token_types(model):
        raise InputError(
            f"{where}: {name}'s text forward reads token type ids (bidirectional attention over image tokens); "
            "its class has no mask hook taking them, so it trains on text only"
        )
    if "mm_token_type_ids" in params and "mm_token_type_ids" not in rope:
        raise InputError(
            f"{where}: {name}'s text forward reads mm_token_type_ids other than for its rope index; not built, "
            "so it trains on text only"
        )
    prefix = path + "." if path else ""
    stack = g.model.stack
    lm = next(
        (c for c, _ in owner.named_children() if stack == prefix + c or stack.startswith(prefix + c + ".")),
        None,
    )
    if lm is None:
        raise InputError(f"{where}: {name}: the decoder stack {stack} is not under the image owner {path}")
    taken = inspect.signature(type(owner.get_submodule(lm)).forward).parameters
    if any(k in taken for k in LAYER_INPUTS):
        raise InputError(
            f"{where}: {name}'s language model takes image features inside its layers (deepstack); carrying "
            "them to the streamed layers is not built yet, so it trains on text only"
        )
    towers = tuple(c for c, _ in owner.named_children() if c != lm)
    return ImageOwner(name, path, lm, towers, bool(rope), types)
