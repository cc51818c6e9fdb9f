"""Image examples -> token rows and the processor's image tensors, by the checkpoint's own
processor (`AutoProcessor`: the chat template, each image's expansion into image tokens, the
resizing and normalisation of the pixels).

    text     processor.apply_chat_template(messages) (the template renders each image part as the
             model's image placeholder)
    ids      processor(text, images, add_special_tokens=False) as transformers' chat templating
             tokenizes; the tensors besides input_ids / attention_mask (pixel_values, image_sizes,
             image_grid_thw, ...) are the example's `media`, dim 0 per image (or patch)
    labels   each assistant turn's tokens: the render up to the turn with the generation prompt,
             and through it, tokenized with the images they hold, the first a prefix of the second
             (else refused: the template renders an earlier turn differently later)

The pixel budget is applied to every image first, as LLaMA-Factory does (`image_max_pixels`,
`image_min_pixels`): an image over `data.max_pixels` pixels (or under `data.min_pixels`) is
resized by one factor on both sides, then converted to RGB.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..data.batch import IGNORE
from ..errors import InputError
from .records import ImageExample

if TYPE_CHECKING:
    from PIL.Image import Image

    from ..config.schema import DataConfig

# a transformers processor (AutoProcessor): its attributes (image_token, tokenizer, ...) and its
# outputs' keys differ by model, so it is not typed further
Processor = Any

# the processor's per-token outputs (Qwen2-VL's mm_token_type_ids, Gemma 3's token_type_ids:
# recomputed from the ids by the processor's rule, vision.tower); the rest are the media, dim 0 per
# image or patch
SKIP = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
STACK = "pixel_attention_mask"  # a per-row image stack's pixel mask (Idefics3, SmolVLM: vision.tower)


def load_processor(hf_dir: Path, where: str) -> Processor:
    """The checkpoint's processor, from the store's hf/ files (convert copies them)."""
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(str(hf_dir))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{where}: cannot load the model's processor from {hf_dir} ({e})"[:400]) from None
    if not hasattr(proc, "image_processor"):
        raise InputError(
            f"{where}: {hf_dir} holds no image processor (processor_config.json / preprocessor_config.json); "
            "convert the multimodal checkpoint with its processor files"
        )
    if not getattr(proc, "chat_template", None):
        raise InputError(f"{where}: the model's processor has no chat template to render image records with")
    return proc


def image_token_id(proc: Processor) -> int:
    """The token the processor expands each image into (the one its token types mark: Gemma 3's
    soft token, not the `<start_of_image>` placeholder it calls its image token)."""
    ids = getattr(proc, "image_token_ids", None)
    if ids and ids[0] is not None:
        return int(ids[0])
    tid = getattr(proc, "image_token_id", None)
    if tid is None:
        tid = proc.tokenizer.convert_tokens_to_ids(proc.image_token)
    return int(tid)


def media_of(out: Processor, image_id: int, where: str) -> dict[str, np.ndarray]:
    """One text's processor outputs -> its media, dim 0 per image (or patch). A per-row stack
    (Idefics3's pixel_values (1, n, C, H, W) beside its pixel mask) loses its row dimension, so
    rows of different image counts concatenate (vision.tower stacks them again). Token types
    the processor gives are checked against the rule the tower rebuilds them with (1 on the image
    tokens): a processor whose types mean more (PaliGemma's prefix) is refused."""
    types = out.get("token_type_ids")
    if types is not None:
        ids = np.asarray(out["input_ids"][0])
        if not np.array_equal(np.asarray(types[0]) == 1, ids == image_id):
            raise InputError(
                f"{where}: the processor's token_type_ids mark other tokens than the image tokens; that "
                "attention mask is not built"
            )
    media = {k: np.asarray(v) for k, v in out.items() if k not in SKIP and v is not None}
    return unstacked(media)


def unstacked(media: dict) -> dict:
    """The processor's tensors in the data's layout: a per-row image stack (STACK) kept one image
    per dim-0 entry, so that rows with different numbers of tiles batch (stacked undoes it)."""
    if STACK not in media:
        return media
    return {k: v[0] if k in (STACK, "pixel_values") else v for k, v in media.items()}


def stacked(kw: dict) -> dict:
    """The tower's keyword tensors as its get_image_features takes them: a per-row image stack
    (Idefics3, SmolVLM: STACK) kept one image per dim-0 entry in the data goes as one stack."""
    if STACK not in kw:
        return kw
    return {k: v[None] if k in (STACK, "pixel_values") else v for k, v in kw.items()}


def budget(img: Image, max_pixels: int, min_pixels: int) -> Image:
    """LLaMA-Factory's rule: one factor on both sides into [min_pixels, max_pixels], then RGB."""
    w, h = img.size
    if w * h > max_pixels:
        f = math.sqrt(max_pixels / (w * h))
        img = img.resize((max(1, int(w * f)), max(1, int(h * f))))
    elif w * h < min_pixels:
        f = math.sqrt(min_pixels / (w * h))
        img = img.resize((int(w * f), int(h * f)))
    return img if img.mode == "RGB" else img.convert("RGB")


def open_image(path: Path, where: str, max_pixels: int, min_pixels: int) -> Image:
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise InputError(f"{where}: image {path} does not exist")
    try:
        with Image.open(path) as img:
            img.load()
            return budget(img, max_pixels, min_pixels)
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise InputError(f"{where}: image {path} is unreadable ({type(e).__name__}: {e})"[:400]) from None


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def processed(proc: Processor, text: str, images: list, where: str) -> Processor:
    """The processor's tensors for one rendered record and its images; its refusal (a chat
    template that writes no image placeholder for an image part, say) as one line."""
    try:
        return proc(text=[text], images=images or None, add_special_tokens=False, return_tensors="np")
    except Exception as e:  # noqa: BLE001 (the processor's own error, named)
        said = " ".join(str(e).split())
        raise InputError(
            f"{where}: the processor refused the record as its chat template renders it "
            f"({type(e).__name__}: {said}); a chat template (data.chat_template) must write a "
            "placeholder for each image part"
        ) from None


class ImageEncoder:
    """Examples -> (input_ids, labels, media) with the processor; counts images and image tokens."""

    def __init__(self, proc: Processor, data_cfg: DataConfig, where: str) -> None:
        self.proc, self.where = proc, where
        self.max_pixels, self.min_pixels = data_cfg.max_pixels, data_cfg.min_pixels
        self.train_on_prompt = data_cfg.train_on_prompt
        self.image_id = image_token_id(proc)

    def _render(self, messages: list[dict], gen: bool) -> str:
        return self.proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    def _ids(self, text: str, images: list, where: str = "") -> tuple[np.ndarray, dict]:
        out = processed(self.proc, text, images, where or self.where)
        ids = np.asarray(out["input_ids"][0], dtype=np.int64)
        return ids, media_of(out, self.image_id, self.where)

    def encode(self, ex: ImageExample, where: str) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        images = [open_image(p, where, self.max_pixels, self.min_pixels) for p in ex.images]
        ids, media = self._ids(self._render(ex.messages, False), images, where)
        labels = ids.copy() if self.train_on_prompt else np.full_like(ids, IGNORE)
        if not self.train_on_prompt:
            seen = 0  # images in the messages before turn k
            for k, m in enumerate(ex.messages):
                n_img = sum(p["type"] == "image" for p in m["content"])
                if m["role"] == "assistant":
                    start = self._prefix(ex.messages[:k], images[:seen], ids, True, where)
                    end = self._prefix(ex.messages[: k + 1], images[: seen + n_img], ids, False, where)
                    labels[start:end] = ids[start:end]
                seen += n_img
        n_tokens = int((ids == self.image_id).sum())
        if ex.images and n_tokens == 0:
            raise InputError(
                f"{where}: the processor put no image token in the text for {len(ex.images)} images"
            )
        return ids, labels, media

    def _prefix(self, messages: list[dict], images: list, full: np.ndarray, gen: bool, where: str) -> int:
        """Tokens of the render of `messages` (a prefix of the full ids)."""
        if not messages:
            return 0
        ids, _ = self._ids(self._render(messages, gen), images, where)
        if len(ids) > len(full) or not np.array_equal(ids, full[: len(ids)]):
            raise InputError(
                f"{where}: the chat template renders turn {len(messages)} differently once later turns "
                "follow, so its loss span cannot be found"
            )
        return len(ids)
