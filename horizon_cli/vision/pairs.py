"""Preference pairs with images (DPO and the other pair losses): records -> a preference ImageSet,
pair k being rows 2k (prompt + chosen) and 2k + 1 (prompt + rejected), both rows carrying the
prompt's image tensors, so that each sequence sees the same image features (TRL's collator
repeats the images for chosen and rejected the same way).

    TRL            `images` + `prompt` (messages whose contents hold image parts; a string is one
                   user message) + `chosen` / `rejected` (assistant message lists, or strings)
    LLaMA-Factory  sharegpt: `images` + `conversations` (the prompt's turns, `<image>`
                   placeholders) + `chosen` / `rejected` (one message each); alpaca:
                   `instruction` / `input` + `chosen` / `rejected` strings (+ `system`)

Tokenised as TRL 1.16's DataCollatorForVisionPreference with trl.data_utils.apply_chat_template:
the prompt rendered with the generation prompt (continuing a final assistant message), the prompt
+ each completion rendered whole, the prompt's text the common prefix of the three renders and
each completion the rest of its render; then processor(prompt, images) and processor(completion),
without special tokens, concatenated. Labels on the completion only; truncation and skips as
data.pairs (a prompt that fills max_seq_len is dropped, so an image token is never cut).
Images belong to the prompt: an image in a completion is refused.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..data.pairs import add_pair, describe
from ..data.preference import Pair
from ..data.records import SHAREGPT_ROLES
from ..data.tokset import MediaBuilder, RowBuilder
from ..errors import InputError
from .encode import ImageEncoder, open_image
from .imageset import ImageSet, Log, records
from .records import ImageExample, _content, _Files, image_example

if TYPE_CHECKING:
    from datasets import Dataset

    from ..config.schema import DataConfig
    from .encode import Processor

SIDES = ("chosen", "rejected")


@dataclass
class ImagePair:
    prompt: ImageExample  # the prompt's messages and its image files
    chosen: list[dict]  # assistant messages, contents as lists of text parts
    rejected: list[dict]


def holds_pairs(columns: Collection[str]) -> bool:
    return all(k in columns for k in SIDES)


def image_pair(record: dict, where: str, base: Path) -> ImagePair:
    """One preference record with images -> its prompt example and its two completions."""
    for k in SIDES:
        if record.get(k) is None:
            raise InputError(f"{where}: {k} is missing")
    ex = image_prompt(record, where, base, "a preference pair")
    return ImagePair(ex, *(completion_messages(record[k], f"{where}: {k}") for k in SIDES))


def image_prompt(record: dict, where: str, base: Path, what: str) -> ImageExample:
    """A record's prompt with its images: TRL's `prompt` (messages, or a string: one user
    message), LLaMA-Factory's `conversations` / `messages` (the prompt's turns) or `instruction` /
    `input` (+ `system`). `what`: the record's kind, for the error."""
    images = record.get("images") or record.get("image")
    if record.get("prompt") is not None:
        prompt = record["prompt"]
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        rec = {"images": images, "messages": msgs}
    elif record.get("conversations") or record.get("messages"):
        rec = {k: record.get(k) for k in ("images", "image", "system", "conversations", "messages")}
    elif record.get("instruction"):
        text = "\n".join(str(record[k]) for k in ("instruction", "input") if record.get(k))
        rec = {
            "images": images,
            "system": record.get("system"),
            "messages": [{"role": "user", "content": text}],
        }
    else:
        raise InputError(
            f"{where}: {what} with images needs its prompt: prompt (TRL), conversations or "
            "instruction (LLaMA-Factory)"
        )
    ex = image_example(rec, where, base)
    if not ex.messages or ex.messages[-1]["role"] not in ("user", "assistant"):
        raise InputError(
            f"{where}: the prompt's last message must be the user's (or an assistant's to continue)"
        )
    return ex


def completion_messages(value: object, where: str) -> list[dict]:
    """A completion -> assistant messages: a string, one message (sharegpt), or a message list."""
    turns = value if isinstance(value, list) else [value]
    out = []
    for turn in turns:
        content: object
        if isinstance(turn, str):
            role, content = "assistant", turn
        elif isinstance(turn, dict):
            role = turn.get("role") or SHAREGPT_ROLES.get(str(turn.get("from")), "assistant")
            content = turn["content"] if "content" in turn else turn.get("value")
        else:
            raise InputError(f"{where}: a completion must be text or messages, not {type(turn).__name__}")
        try:
            parts = _content(content, _Files(None, where), where)
        except InputError:  # an <image> placeholder: no file left for it
            parts = [{"type": "image"}]
        if any(p["type"] == "image" for p in parts):
            raise InputError(f"{where}: an image in a completion; images go in the prompt")
        out.append({"role": role, "content": parts})
    if not out:
        raise InputError(f"{where}: the completion is empty")
    return out


def encode_pair(enc: ImageEncoder, pair: ImagePair, where: str) -> tuple[Pair, dict[str, np.ndarray]]:
    """(prompt, chosen, rejected) ids and the prompt's image tensors, as TRL tokenises them."""
    prompt, (chosen, rejected), media = encode_prompted(enc, pair.prompt, [pair.chosen, pair.rejected], where)
    return Pair(prompt, chosen, rejected), media


def encode_prompted(
    enc: ImageEncoder, ex: ImageExample, completions: list[list[dict]], where: str
) -> tuple[np.ndarray, list[np.ndarray], dict[str, np.ndarray]]:
    """A prompt with images and its completions -> the prompt's ids, each completion's ids (int32)
    and the prompt's image tensors, as TRL's vision collators tokenise them (the module's rule)."""
    proc, msgs = enc.proc, ex.messages
    gen = msgs[-1]["role"] == "user"
    prompt = proc.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=gen, continue_final_message=not gen
    )
    whole = [proc.apply_chat_template(msgs + side, tokenize=False) for side in completions]
    for w in whole:  # trl.data_utils.apply_chat_template: the common prefix (DeepSeek-R1's <tool_call>)
        prompt = "".join(a for a, _ in takewhile(lambda ab: ab[0] == ab[1], zip(prompt, w, strict=False)))
    images = [open_image(p, where, enc.max_pixels, enc.min_pixels) for p in ex.images]
    ids, media = enc._ids(prompt, images)
    if images and not (ids == enc.image_id).any():
        raise InputError(f"{where}: the processor put no image token in the prompt for {len(images)} images")
    comps = [enc._ids(w[len(prompt) :], [])[0].astype(np.int32) for w in whole]
    return ids.astype(np.int32), comps, media


def build_image_pairs(
    ds: Dataset, proc: Processor, data_cfg: DataConfig, name: str, log: Log, base: Path
) -> ImageSet:
    """A source's preference records with images -> a preference ImageSet (two rows a pair)."""
    if data_cfg.packing:
        raise InputError(
            f"data.packing: {name} holds pairs with images; pairs are not packed (set packing: false)"
        )
    enc = ImageEncoder(proc, data_cfg, name)
    stats: dict = {
        "records": 0,
        "pairs": 0,
        "truncated": 0,
        "cut_tokens": 0,
        "form": "images",
        "skipped": {},
        "images": 0,
        "image_tokens": 0,
    }
    rows, media = RowBuilder(), MediaBuilder()
    for where, rec in records(ds, name):
        stats["records"] += 1
        pair = image_pair(rec, where, base)
        ids, m = encode_pair(enc, pair, where)
        if not add_pair(ids, rows, data_cfg.max_seq_len, stats):
            continue
        media.add(m)  # the chosen row's
        media.add(m)  # the rejected row's: the same tensors
        stats["images"] += len(pair.prompt.images)
        stats["image_tokens"] += int((ids.prompt == enc.image_id).sum())
    ts = rows.build("preference", stats)
    arrays, offs = media.arrays()
    stats.update(rows=len(ts), tokens=ts.num_tokens, label_tokens=ts.label_tokens)
    log(
        f"data: {name}: {describe(stats, data_cfg.max_seq_len)}; {stats['images']} images, "
        f"{stats['image_tokens']} image tokens (data.max_pixels {data_cfg.max_pixels}, "
        f"data.min_pixels {data_cfg.min_pixels})"
    )
    if not stats["pairs"]:
        raise InputError(f"{name}: no preference pair to train on ({describe(stats, data_cfg.max_seq_len)})")
    return ImageSet(ts.tokens, ts.labels, ts.offsets, None, "preference", stats, None, arrays, offs)
