"""Prompt-only data (`data.format: prompt`, TRL's prompt-only format), for online RL (rl/).

A record holds one of
    prompt            text, tokenized as the tokenizer does by default (its BOS included), as
                      TRL's GRPOTrainer tokenizes a standard prompt; or a conversation
                      [{role, content}, ...] rendered with the chat template and its generation
                      prompt (conversational: the completions are then message lists too)
    prompt_input_ids  token ids, used as given
and any other columns, which are kept as read and passed to the reward functions by name
(TRL's convention: `solution`, `answer`, ...). `auto` detects the format when a record has a
prompt and no completion, chosen/rejected, messages or text (data.formats).

Held-out prompts: `data.eval_path` (read alike) or `data.eval_fraction` (the last fraction of a
permutation seeded by train.seed). A prompt that leaves no room for a completion within
data.max_seq_len and the model's positions is refused, naming its record.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InputError
from .encode import NoTokenizer
from .formats import is_prompt_only
from .images import ImageData, names_images
from .prompts import _ids
from .source import load_records, open_source

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FIELDS = ("prompt", "prompt_input_ids")


@dataclass
class PromptImages:
    """How a prompt that names images is read: by the model's image data (data.images.ImageData),
    or refused with `reason` (what the model is: text only, by default)."""

    data: ImageData | None = None
    reason: str = "the model takes text only (no vision tower)"
    data_cfg: object = None  # the data: section (its pixel budget), set by prepare_prompts

    def encode(self, record: dict, where: str, base: Path):
        if self.data is None:
            raise InputError(
                f"{where}: the prompt names images, and {self.reason}; train a multimodal checkpoint, "
                "or drop the images"
            )
        return self.data.prompt(record, where, base, self.data_cfg)


@dataclass
class PromptRow:
    ids: list[int]
    prompt: object  # as read: text, a message list, or the ids
    columns: dict  # every other column of the record (the reward functions' keyword lists)
    where: str
    media: dict | None = None  # the processor's image tensors of a prompt that names images


@dataclass
class PromptSet:
    rows: list[PromptRow]
    conversational: bool
    tokenizer: PreTrainedTokenizerBase | None = None  # what encoded them (rl decodes completions with it)
    format: str = "prompt"

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, idx) -> list[PromptRow]:
        return [self.rows[int(i)] for i in idx]


def read_prompts(
    path: str, what: str, tokenizer, vocab: int, room: int, split: str = "train", images=None
) -> PromptSet:
    """Every record of `path` as a prompt; room: the most prompt tokens a record may have.
    images: PromptImages (a record that names images goes to it; its reason when it has no
    ImageData: a text-only model)."""
    src = open_source(path, split, what)
    ds = load_records(src)
    base = Path(src.path).parent if src.kind == "file" else Path(src.path)
    cols = list(ds.column_names)
    if not is_prompt_only(cols):
        raise InputError(
            f"{what}: {path}: prompt-only data needs a prompt or prompt_input_ids column and no completion (has {cols})"
        )
    rows, conv, wrapped = [], None, None
    for n, rec in enumerate(ds.to_list()):
        at = f"{path}: record {n + 1}"  # from 1, in file order, as every other format
        kind = "prompt_input_ids" if rec.get("prompt_input_ids") is not None else "prompt"
        value = rec.get(kind)
        if value is None:
            raise InputError(f"{at}: no prompt")
        as_kind = (
            "input_ids" if kind == "prompt_input_ids" else "messages" if isinstance(value, list) else "prompt"
        )
        if as_kind != "input_ids" and tokenizer is None and not names_images(rec):  # the processor's
            raise NoTokenizer("prompt", f" ({at}: or give prompt_input_ids)")  # train.inputs names the files
        media = None
        if names_images(rec):
            ids, media = (images or PromptImages()).encode(rec, at, base)
        else:
            ids = _ids({as_kind: value}, as_kind, tokenizer, vocab, at)
        if not ids:
            raise InputError(f"{at}: the prompt is empty (0 tokens)")
        if len(ids) > room:
            raise InputError(
                f"{at}: the prompt is {len(ids)} tokens; at most {room} leave room for a completion "
                "(data.max_seq_len and the model's positions, less rl.max_completion_length)"
            )
        c = as_kind == "messages"
        if conv is not None and c != conv:
            raise InputError(f"{at}: mixes conversational and text prompts (TRL reads one kind per set)")
        conv = c
        if as_kind == "prompt":  # with images: rendered as a user message; without: as text
            w = names_images(rec)
            if wrapped is not None and w != wrapped:
                raise InputError(
                    f"{at}: text prompts with and without images in one set: those with images are "
                    "rendered as a user message with the chat template, those without as plain text; "
                    "give the prompts as messages (TRL's multimodal training takes conversational prompts)"
                )
            wrapped = w
        extra = {k: v for k, v in rec.items() if k not in FIELDS}
        rows.append(PromptRow(ids, value, extra, at, media))
    if not rows:
        raise InputError(f"{what}: {path}: no prompts (the data set is empty)")
    return PromptSet(rows, bool(conv), tokenizer)


def prepare_prompts(
    data_cfg, tokenizer, vocab: int, max_positions: int, completion: int, seed: int, images=None
):
    """(train, eval or None) prompt sets of the `data:` section; images: PromptImages."""
    if isinstance(data_cfg.path, list):
        src = data_cfg.path[0]
        path, split = src.path, src.split or data_cfg.split
    else:
        path, split = data_cfg.path, data_cfg.split
    if images is not None:
        images = replace(images, data_cfg=data_cfg)
    room = min(data_cfg.max_seq_len, max_positions) - completion
    if room < 1:
        raise InputError(
            f"rl.max_completion_length: {completion} leaves no room for a prompt within data.max_seq_len "
            f"{data_cfg.max_seq_len} (and the model's {max_positions} positions)"
        )
    train = read_prompts(path, "data.path", tokenizer, vocab, room, split, images)
    ev = None
    if data_cfg.eval_path:
        ev = read_prompts(data_cfg.eval_path, "data.eval_path", tokenizer, vocab, room, images=images)
    elif data_cfg.eval_fraction > 0:
        order = np.random.default_rng(seed).permutation(len(train))
        k = int(round(len(train) * data_cfg.eval_fraction))
        if k < 1 or k >= len(train):
            raise InputError(
                f"data.eval_fraction: {data_cfg.eval_fraction:g} of {len(train)} prompts leaves none on one side"
            )
        keep, held = sorted(order[:-k].tolist()), sorted(order[-k:].tolist())
        train, ev = (PromptSet(train.take(ix), train.conversational, tokenizer) for ix in (keep, held))
    if ev is not None and any(r.media for r in ev.rows) and not any(r.media for r in train.rows):
        raise InputError(
            "data.eval_path: held-out prompts name images and the training prompts none; the tower runs "
            "only for a run that trains with images (give the training prompts their images, or drop them)"
        )
    return train, ev
