"""`horizon generate` with images: prompts whose messages hold image parts (the same forms as the
training data: vision.records), rendered with the processor's chat template and its generation
prompt, tokenized with their images by the processor; the image tensors go with the prompt to
the prefill (generate.decoder), where the embedding stage merges the tower's features
(vision.embed) exactly as in training."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..data.images import names_images
from ..errors import InputError
from .encode import Processor, image_token_id, load_processor, media_of, open_image, processed
from .records import ImageExample, image_example
from .support import image_owner, is_multimodal

if TYPE_CHECKING:
    from ..store.files import ModelFiles


def image_prompts(
    store: ModelFiles, records: list[tuple[dict, str]], base: Path, max_pixels: int, min_pixels: int
) -> dict[int, tuple[list[int], dict]]:
    """{index: (ids, media)} for the records that name images (an InputError for a text-only
    model, or a model whose image path is not built)."""
    which = [k for k, (rec, _) in enumerate(records) if names_images(rec)]
    if not which:
        return {}
    first = records[which[0]][1]
    if not is_multimodal(store.arch):
        raise InputError(
            f"{first}: the prompt names images, and {store.root} takes text only (no vision tower)"
        )
    where = f"model.path: {store.root}"
    image_owner(store.arch, where)
    proc = load_processor(Path(store.root) / "hf", where)
    out = {}
    for k in which:
        rec, at = records[k]
        out[k] = encode_prompt(proc, image_example(rec, at, base), at, max_pixels, min_pixels)
    return out


def encode_prompt(
    proc: Processor, ex: ImageExample, at: str, max_pixels: int, min_pixels: int
) -> tuple[list[int], dict]:
    """One prompt's example -> (ids, media): its messages rendered with the generation prompt (as
    TRL's GRPOTrainer and transformers' generate do), tokenized with its images by the processor."""
    if ex.messages and ex.messages[-1]["role"] == "assistant":
        raise InputError(f"{at}: a prompt ends with a user turn (the model answers it)")
    text = proc.apply_chat_template(ex.messages, tokenize=False, add_generation_prompt=True)
    images = [open_image(p, at, max_pixels, min_pixels) for p in ex.images]
    got = processed(proc, text, images, at)
    ids = [int(t) for t in np.asarray(got["input_ids"][0])]
    media = {n: torch.from_numpy(v) for n, v in media_of(got, image_token_id(proc), at).items()}
    return ids, media


def prompt_record(record: dict) -> dict:
    """A prompt-only record (TRL: `prompt` as messages or text, images in its parts or in an
    `image` / `images` column) -> an image record (vision.records) of its messages."""
    prompt = record.get("prompt")
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return {"images": record.get("images") or record.get("image"), "messages": msgs}
