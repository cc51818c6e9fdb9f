"""Image data as the data pipeline sees it: a TokenSet whose rows carry the processor's image
tensors (`media`), built from one source's records, and the data summary's image counts.

    media          name -> (N, ...) every row's tensors of that name back to back along dim 0
                   (pixel_values: one per image, or per patch for Qwen-style processors)
    media_offsets  name -> (rows + 1,) int64: row r holds media[name][off[r]:off[r + 1]]

A row's `media` is what the processor returned for it; collation concatenates the rows' along
dim 0, which is what the processor returns for a batch. Rows are one example each (packing image
rows is refused), truncated to `data.max_seq_len` only where the cut keeps every image token; an
example whose image tokens do not fit is dropped and counted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..data.batch import IGNORE
from ..data.tokset import MediaBuilder, Row, RowBuilder, TokenSet
from ..errors import InputError
from .encode import ImageEncoder, file_digest
from .records import ImageExample, image_example

if TYPE_CHECKING:
    from datasets import Dataset

    from ..config.schema import DataConfig
    from .encode import Processor

Log = Callable[[str], None]

RECORDS_PER_BATCH = 256


@dataclass
class ImageSet(TokenSet):
    media: dict[str, np.ndarray] = field(default_factory=dict)
    media_offsets: dict[str, np.ndarray] = field(default_factory=dict)

    def __getitem__(self, i: int) -> Row:
        row = super().__getitem__(i)
        n = len(self)
        i = i % n
        r = int(i if self.index is None else self.index[i])
        row.media = {
            k: v[int(self.media_offsets[k][r]) : int(self.media_offsets[k][r + 1])]
            for k, v in self.media.items()
        }
        return row

    def select(self, rows: np.ndarray) -> ImageSet:
        view = super().select(rows)
        return ImageSet(
            view.tokens,
            view.labels,
            view.offsets,
            view.doc_ids,
            view.format,
            view.stats,
            view.index,
            self.media,
            self.media_offsets,
        )


def records(ds: Dataset, name: str) -> Iterator[tuple[str, dict]]:
    """A source's records in order, read RECORDS_PER_BATCH at a time, each with its name for
    messages (`NAME: record N`, from 1)."""
    k = 0
    for batch in ds.iter(batch_size=RECORDS_PER_BATCH):
        for vals in zip(*batch.values(), strict=True):
            k += 1
            yield f"{name}: record {k}", dict(zip(batch, vals, strict=True))


def build_image_set(
    ds: Dataset, proc: Processor, data_cfg: DataConfig, name: str, log: Log, base: Path
) -> ImageSet:
    """One source's records (each with images, or text alone) -> an ImageSet."""
    if data_cfg.packing:
        raise InputError(
            f"data.packing: {name} holds images; rows with images are not packed (set packing: false)"
        )
    enc = ImageEncoder(proc, data_cfg, name)
    stats = {
        "records": 0,
        "examples": 0,
        "images": 0,
        "image_tokens": 0,
        "truncated": 0,
        "too_long": 0,
        "no_labels": 0,
        "cut_tokens": 0,
        "cut_label_tokens": 0,
    }
    rows, media = RowBuilder(), MediaBuilder()
    for where, rec in records(ds, name):
        stats["records"] += 1
        ex = image_example(rec, where, base)
        ids, labels, m = enc.encode(ex, where)
        fit = _fit(ids, labels, enc.image_id, data_cfg.max_seq_len, stats)
        if fit is None:
            continue
        ids, labels = fit
        if not (labels[1:] != IGNORE).any():
            stats["no_labels"] += 1
            continue
        rows.add(ids, labels)
        media.add(m)
        stats["examples"] += 1
        stats["images"] += len(ex.images)
        stats["image_tokens"] += int((ids == enc.image_id).sum())
    ts = rows.build("chat", stats)
    arrays, offs = media.arrays()
    stats.update(rows=len(ts), tokens=ts.num_tokens, label_tokens=ts.label_tokens)
    log(f"data: {name}: {describe(stats, data_cfg)}")
    return ImageSet(ts.tokens, ts.labels, ts.offsets, None, "chat", stats, None, arrays, offs)


def _fit(
    ids: np.ndarray, labels: np.ndarray, image_id: int, max_len: int, stats: dict
) -> tuple[np.ndarray, np.ndarray] | None:
    """Truncated to max_len when every image token stays; else None, counted."""
    if len(ids) <= max_len:
        return ids, labels
    if (ids[max_len:] == image_id).any():
        stats["too_long"] += 1
        return None
    stats["truncated"] += 1
    stats["cut_tokens"] += len(ids) - max_len
    stats["cut_label_tokens"] += int((labels[max_len:] != IGNORE).sum())
    return ids[:max_len], labels[:max_len]


def describe(s: dict, data_cfg: DataConfig) -> str:
    text = (
        f"{s['records']} records -> {s['examples']} examples; {s['tokens']} tokens, {s['label_tokens']} "
        f"with loss; {s['images']} images, {s['image_tokens']} image tokens "
        f"(data.max_pixels {data_cfg.max_pixels}, data.min_pixels {data_cfg.min_pixels})"
    )
    if s["truncated"]:
        text += f"; {s['truncated']} truncated to max_seq_len {data_cfg.max_seq_len} ({s['cut_tokens']} tokens cut)"
    if s["too_long"] or s["no_labels"]:
        text += (
            f"; {s['too_long'] + s['no_labels']} dropped ({s['too_long']} whose image tokens do not fit "
            f"max_seq_len {data_cfg.max_seq_len}, {s['no_labels']} without loss tokens)"
        )
    return text


def images_key(
    ds: Dataset,
    proc: Processor,
    data_cfg: DataConfig,
    base: Path,
    parse: Callable[[dict, str, Path], ImageExample] = image_example,
) -> str | None:
    """sha256 of what an ImageSet depends on beyond the data file and the tokenizer: the
    processor's settings, chat template and template kwargs, the pixel budget, train_on_prompt, max_seq_len and
    the content of every image the records name (None when one cannot be read: no cache).
    parse: a record -> its ImageExample (vision.pairs: a pair's prompt)."""
    h = hashlib.sha256(json.dumps(proc.to_dict(), sort_keys=True, default=str).encode())
    template = [proc.chat_template, dict(data_cfg.chat_template_kwargs or {})]  # load_processor: one
    h.update(json.dumps(template, sort_keys=True, default=str).encode())  # data.chat_template(_kwargs)
    h.update(
        f"{data_cfg.max_pixels}:{data_cfg.min_pixels}:{data_cfg.train_on_prompt}:{data_cfg.max_seq_len}".encode()
    )
    seen: dict[Path, str] = {}
    for k, rec in enumerate(ds):
        try:
            ex = parse(rec, f"record {k + 1}", base)
        except InputError:
            return None  # the build says what is wrong
        for p in ex.images:
            if p not in seen:
                if not p.is_file():
                    return None
                seen[p] = file_digest(p)
            h.update(f"{p}:{seen[p]}".encode())
    return h.hexdigest()
