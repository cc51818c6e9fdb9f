"""Which multimodal checkpoints train with images, read off transformers' own classes (built on
the meta device), not a table of families.

The image path needs the module transformers merges images with (the *image owner*: LLaVA's
`LlavaModel`, Mistral 3's, ...) to offer `get_image_features` (tower + projector) and
`get_placeholder_mask` (where the features go among the embeddings), and its text forward to need
nothing else from the images. An owner with `get_rope_index` (Qwen2-VL, Qwen2.5-VL: multimodal
rotary position ids from the image grid) gets its position ids from it per micro-batch
(vision.tower.VisionTower.positions), which reach every streamed layer as the position ids. What is refused, each named:

    no image owner          the class has no get_image_features / get_placeholder_mask pair
                            (cross-attention image layers: Mllama; Idefics3's own merger)
    deepstack               a language model that takes image features inside its layers
                            (Qwen3-VL's deepstack_visual_embeds): not yet carried to the layers
    token_type_ids          a text forward that attends bidirectionally over image tokens
                            (Gemma 3, PaliGemma): not yet built
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from ..arch import ArchSpec
from ..errors import InputError

MASK_INPUTS = ("token_type_ids", "mm_token_type_ids")
LAYER_INPUTS = ("deepstack_visual_embeds", "visual_pos_masks")  # image features given to the layers


@dataclass(frozen=True)
class ImageOwner:
    cls: str  # the checkpoint's transformers class
    owner: str  # module path of the image owner ("" for the top model)
    lm: str  # the owner's child that holds the decoder stack (its language model)
    towers: tuple[str, ...]  # the owner's other children: tower(s) and projector
    rope: bool = False  # the owner computes multimodal rotary position ids (get_rope_index)


def is_multimodal(arch: ArchSpec) -> bool:
    g = arch.generic
    return g is not None and bool(g.carried)


def find_owner(model, stack: str):
    """(path, module) of the first module with both image methods, or None."""
    for path, mod in model.named_modules():
        if hasattr(mod, "get_image_features") and hasattr(mod, "get_placeholder_mask") and path != stack:
            return path, mod
    return None


def image_owner(arch: ArchSpec, where: str, model=None) -> ImageOwner:
    """The image owner of a multimodal store's class, or an InputError naming what is missing."""
    from ..arch.generic import stored_model

    g = arch.generic
    assert g is not None and g.model is not None
    model = model if model is not None else stored_model(g)
    name = g.cls or type(model).__name__
    found = find_owner(model, g.model.stack)
    if found is None:
        raise InputError(
            f"{where}: {name} has no get_image_features + get_placeholder_mask pair in transformers (its images "
            "enter otherwise: cross-attention layers or its own merger), so it trains on text only"
        )
    path, owner = found
    params = inspect.signature(type(owner).forward).parameters
    rope = (
        set(inspect.signature(owner.get_rope_index).parameters) if hasattr(owner, "get_rope_index") else set()
    )
    if any(k in params and k not in rope for k in MASK_INPUTS):  # Qwen's mm_token_type_ids: its rope index
        raise InputError(
            f"{where}: {name}'s text forward reads token type ids (bidirectional attention over image tokens); "
            "that mask is not built yet, so it trains on text only"
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
    return ImageOwner(name, path, lm, towers, bool(rope))
