"""Unpaired preference (KTO) records with images -> the examples' ImageSet (format `unpaired`: one
row per example, prompt + completion, labels on the completion, the prompt's image tensors), as
TRL 1.16's DataCollatorForVisionUnpairedPreference tokenises them (vision.pairs' rule with one
completion: the prompt rendered with the generation prompt, the completion the rest of the whole
render; processor(prompt, images) + processor(completion), without special tokens).

    TRL            `images` (or `image`) + `prompt` (messages whose contents hold image parts; a
                   string is one user message) + `completion` (assistant messages, or a string)
                   + `label` (bool)
    LLaMA-Factory  sharegpt: `images` + `conversations` / `messages` (the last an assistant's: the
                   completion; the turns before it the prompt, `<image>` placeholders) + `kto_tag`;
                   alpaca: `images` + `instruction` / `input` (+ `system`) + `output` + `kto_tag`

Each example's mismatched (KL) completion is added later, as for text (data.unpaired.kto_rows: the
completions rotated by one within blocks of train.batch_size examples; TRL's vision collator
rotates within its batch of per_device_train_batch_size), and that row carries the example's own
image tensors: TRL's KL sequence is the prompt's ids, processed with its images, + another
example's completion, forwarded with the batch's pixel values.

What differs from TRL: an example whose prompt alone fills max_seq_len is dropped (as the text path
and TRL's text preparation drop it; TRL's vision collator would cut its image tokens and fail). As
TRL's KTOTrainer, preference pairs with images are refused for KTO (unpaired text pairs are
unpaired, data.unpaired.unpair): vision.run says so in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..data.records import SHAREGPT_ROLES
from ..data.tokset import MediaBuilder
from ..data.unpaired import Example, blank, desirable_of, example_rows, fits, unpaired_form
from ..errors import InputError
from .encode import ImageEncoder
from .imageset import ImageSet, Log, records
from .pairs import completion_messages, encode_prompted, image_prompt
from .records import ImageExample

if TYPE_CHECKING:
    from datasets import Dataset

    from ..config.schema import DataConfig
    from .encode import Processor

WHAT = "an unpaired preference (KTO) record"


def unpaired_parts(record: dict, form: str, where: str, base: Path) -> tuple[ImageExample, object] | None:
    """One record (data.unpaired's `form`) -> its prompt example and its raw completion, or None
    for an empty completion (skipped, as the text path skips it)."""
    if form == "trl":
        comp = record.get("completion")
        if comp is None:
            raise InputError(f"{where}: has no 'completion'")
        prompt = record
    elif form == "alpaca":
        comp = record.get("output")
        if comp is None:
            raise InputError(f"{where}: has no 'output' (the completion)")
        prompt = {k: record.get(k) for k in ("images", "image", "system", "instruction", "input")}
    else:
        key = "messages" if record.get("messages") else "conversations"
        turns = record.get(key) or []
        last = turns[-1] if isinstance(turns, list) and turns else None
        if not isinstance(last, dict) or _role(last) != "assistant":
            raise InputError(f"{where}: the last message must be the assistant's completion")
        comp = last
        prompt = {**{k: record.get(k) for k in ("images", "image", "system")}, key: turns[:-1]}
    if blank(comp if not isinstance(comp, dict) else [{"content": comp.get("content", comp.get("value"))}]):
        return None
    return image_prompt(prompt, where, base, WHAT), comp


def _role(turn: dict) -> str | None:
    return turn.get("role") or SHAREGPT_ROLES.get(str(turn.get("from")))


def build_image_unpaired(
    ds: Dataset, proc: Processor, data_cfg: DataConfig, name: str, log: Log, base: Path
) -> ImageSet:
    """A source's unpaired preference records with images -> the examples' ImageSet (one row each)."""
    if data_cfg.packing:
        raise InputError(
            f"data.packing: {name} holds preference examples with images; they are not packed (set packing: false)"
        )
    form = unpaired_form(list(ds.column_names))
    assert form is not None, "vision.run routes unpaired records here"
    enc = ImageEncoder(proc, data_cfg, name)
    examples: list[Example] = []
    medias, images, n_records, empty = [], [], 0, 0
    for where, rec in records(ds, name):
        n_records += 1
        desirable = desirable_of(rec, form, where)
        parts = unpaired_parts(rec, form, where, base)
        if parts is None:
            empty += 1
            continue
        ex, comp = parts
        prompt, (ids,), m = encode_prompted(
            enc, ex, [completion_messages(comp, f"{where}: completion")], where
        )
        examples.append(Example(prompt, ids, desirable))
        medias.append(m)
        images.append(len(ex.images))
    max_len = data_cfg.max_seq_len
    kept = [k for k, e in enumerate(examples) if fits(e, max_len)]
    ts = example_rows(examples, max_len, {"records": n_records, "form": form, "empty": empty})
    media = MediaBuilder()
    for k in kept:
        media.add(medias[k])
    n_images = sum(images[k] for k in kept)
    n_tokens = sum(int((examples[k].prompt == enc.image_id).sum()) for k in kept)
    ts.stats.update(
        images=n_images, image_tokens=n_tokens, tokens=ts.num_tokens, label_tokens=ts.label_tokens
    )
    des, dropped = sum(ts.stats["desirable"]), ts.stats["dropped"]
    log(
        f"data: {name}: {n_records} records -> {len(ts)} examples ({des} desirable, {len(ts) - des} undesirable; "
        f"{form} form); {n_images} images, {n_tokens} image tokens (data.max_pixels {data_cfg.max_pixels}, "
        f"data.min_pixels {data_cfg.min_pixels})"
        + (f"; {dropped} dropped (the prompt fills max_seq_len)" if dropped else "")
        + (f"; {empty} skipped (an empty completion)" if empty else "")
    )
    if not len(ts):
        raise InputError(f"{name}: no unpaired preference example to train on")
    arrays, offs = media.arrays()
    return ImageSet(ts.tokens, ts.labels, ts.offsets, None, "unpaired", ts.stats, None, arrays, offs)


def unpaired_prompt(form: str) -> Callable[[dict, str, Path], ImageExample]:
    """record -> its prompt example (vision.imageset.images_key's parse); a record with an empty
    completion, which the build skips, gives an empty one."""

    def parse(record: dict, where: str, base: Path) -> ImageExample:
        parts = unpaired_parts(record, form, where, base)
        return parts[0] if parts is not None else ImageExample([])

    return parse
