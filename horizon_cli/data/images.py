"""Records that name images: how the data pipeline tells them apart, and the seam through which a
multimodal model's image data is built (vision.imageset; this layer does not know processors).

A record names images when its `images` field lists any (LLaMA-Factory, TRL) or a message's
content holds an image part ({"type": "image" | "image_url", ...}, transformers' chat form).
For a model with no image input (no `ImageData` given) such a record is refused by name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

from ..errors import InputError

IMAGE_TYPES = ("image", "image_url")
TURNS = ("messages", "conversations", "chosen", "rejected", "prompt", "completion")  # TRL: prompt too


class ImageData(Protocol):
    """A multimodal model's image data: one source's records -> a TokenSet whose rows carry media."""

    def build(self, ds, data_cfg, name: str, log, base: Path): ...

    def key(self, ds, data_cfg, base: Path) -> str | None:
        """What the tokens depend on beyond the file and the tokenizer: the processor, the pixel
        budget and every image's content (None: an image cannot be read; no cache then)."""
        ...

    def wrap(self, ts, media: dict, offsets: dict): ...

    def prompt(self, record: dict, where: str, base: Path, data_cfg):
        """A prompt-only record that names images (online RL) -> (ids, media), or an InputError."""
        ...


def names_images(record: dict) -> bool:
    """The record lists images, or a message content holds an image part."""
    if record.get("images") or record.get("image"):
        return True
    for key in TURNS:
        turns = record.get(key)
        for turn in turns if isinstance(turns, list) else []:
            content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
            if isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") in IMAGE_TYPES for p in content
            ):
                return True
    return False


def first_with_images(ds) -> int | None:
    """The 1-based index of the first record that names images, or None."""
    # a turn column is read only when its schema may hold content parts (a `type` field, or
    # contents of mixed kinds, which `datasets` reads as Json)
    cols = [c for c in ("images", "image") if c in ds.column_names]
    cols += [c for c in TURNS if c in ds.column_names and re.search(r"'type'|Json", repr(ds.features[c]))]
    if not cols:
        return None
    n = 0
    for batch in ds.select_columns(cols).iter(batch_size=1000):
        for vals in zip(*batch.values(), strict=True):
            n += 1
            if names_images(dict(zip(batch, vals, strict=True))):
                return n
    return None


def refuse_images(ds, name: str, model: str) -> None:
    """InputError when a record names images and the model takes none."""
    first = first_with_images(ds)
    if first is not None:
        raise InputError(
            f"{name}: record {first} names images, and {model} takes text only (no vision tower); "
            "train a multimodal checkpoint, or drop the images"
        )
