"""Data stage 3b, preference pairs as rows: pair k is rows 2k (prompt + chosen) and 2k + 1
(prompt + rejected), labels on the completion only; sampled, split and collated pair by pair.

    build_pairs    records -> Pairs (data.preference) -> truncated as TRL's DataCollatorForPreference
                   (each sequence keeps its first max_seq_len tokens) after TRL's dataset preparation
                   (a pair whose prompt alone fills max_seq_len is dropped) -> TokenSet (format
                   `preference`) and the counts the data summary gives
    PairSet        a TokenSet seen as pairs: len() counts pairs, rows(pairs) gives both rows of each,
                   select(pairs) a split, so the sampler and the eval split never part a pair
    collate_pairs  a global batch of pairs -> micro-batches of whole pairs, each with what the
                   pair objective reads (recipes.preference.loss), its PairPayload: `ref` (b,) the
                   reference log-probs, and the global batch's `pairs`, `chosen_tokens` (completion
                   labels of the chosen rows) and `chosen_seq_tokens` (every predicted position of
                   the chosen rows, ORPO's NLL)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError
from .batch import IGNORE, MicroBatch
from .collate import collate
from .encode import Vocab
from .fields import Unread, unread_columns
from .preference import Pair, PairEncoder, columns_of, pair_form
from .tokset import Row, RowBuilder, RowTable, TokenSet

RECORDS_PER_BATCH = 1000
PROMPT_FILLS, NO_LABELS = "prompt fills max_seq_len", "nothing to predict"
NAMED = 5  # skipped records named in the summary, per reason
Log = Callable[[str], None]


def build_pairs(
    ds, tokenizer, data_cfg, name: str, log: Log, vocab: Vocab | None, adapt: Callable | None = None
) -> TokenSet:
    """A dataset of preference records -> its TokenSet of pairs (two rows each). `adapt`: a
    function of a batch of columns applied before encoding (a registry's message tags)."""
    form = pair_form(list(ds.column_names))
    read = columns_of(form, ds.column_names)
    judge = Unread("preference", name, frozenset(data_cfg.ignore_fields))
    ignored = unread_columns(ds, read, judge)  # refuses meaning (kto_tag, score, ...) before any work
    enc = PairEncoder(form, tokenizer, name, vocab, judge)
    stats: dict = {"records": 0, "pairs": 0, "truncated": 0, "cut_tokens": 0, "form": form, "skipped": {}}
    rows = RowBuilder()
    for batch in ds.select_columns(read).iter(batch_size=RECORDS_PER_BATCH):
        for res in enc.encode(adapt(batch) if adapt else batch, first=stats["records"] + 1):
            stats["records"] += 1
            add_pair(res, rows, data_cfg.max_seq_len, stats)
    ts = rows.build("preference", stats)
    ignored += enc.notes
    stats.update(
        rows=len(ts), tokens=ts.num_tokens, label_tokens=ts.label_tokens, ignored_fields=dict(ignored)
    )
    log(f"data: {name}: {describe(stats, data_cfg.max_seq_len)}")
    for why, (n, first) in stats["skipped"].items():
        recs = ", ".join(map(str, first)) + (", ..." if n > len(first) else "")
        log(
            f"warning: {name}: {n} pair{'s' if n > 1 else ''} skipped ({why}): record{'s' if n > 1 else ''} {recs}"
        )
    if not stats["pairs"]:
        raise InputError(f"{name}: no preference pair to train on ({describe(stats, data_cfg.max_seq_len)})")
    return ts


def add_pair(res: Pair | str, rows: RowBuilder, max_len: int, stats: dict) -> bool:
    """One record's pair -> two rows (truncated), or the reason it gives none, counted; whether
    the pair was added (vision.pairs adds its images to both rows then)."""
    if isinstance(res, str):
        return _skip(stats, res)
    n_prompt = len(res.prompt)
    if n_prompt >= max_len:  # TRL drops these: keep_start truncation would leave no completion token
        return _skip(stats, PROMPT_FILLS)  # (with images: the prompt holds them, so none is ever cut)
    seqs, cut = [], 0
    for comp in (res.chosen, res.rejected):
        ids = np.concatenate([res.prompt, comp]).astype(np.int32)
        labels = np.concatenate([np.full(n_prompt, IGNORE, np.int32), comp]).astype(np.int32)
        cut += max(0, len(ids) - max_len)
        seqs.append((ids[:max_len], labels[:max_len]))
    if any(not (lab[1:] != IGNORE).any() for _, lab in seqs):
        return _skip(stats, NO_LABELS)
    for ids, labels in seqs:
        rows.add(ids, labels)
    stats["pairs"] += 1
    stats["truncated"] += int(cut > 0)
    stats["cut_tokens"] += cut
    return True


def _skip(stats: dict, why: str) -> bool:
    n, first = stats["skipped"].get(why, (0, []))
    stats["skipped"][why] = (n + 1, first + [stats["records"]] if len(first) < NAMED else first)
    return False


def describe(s: dict, max_len: int) -> str:
    text = f"{s['records']} records -> {s['pairs']} pairs ({s['form']} form)"
    if "tokens" in s:
        text += f"; {s['tokens']} tokens, {s['label_tokens']} with loss"
    if s["truncated"]:
        text += (
            f"; {s['truncated']} pairs truncated to max_seq_len {max_len} "
            f"(completions cut at the end, {s['cut_tokens']} tokens)"
        )
    skipped = {why: n for why, (n, _) in s["skipped"].items()}
    if skipped:
        text += (
            f"; {sum(skipped.values())} skipped (" + ", ".join(f"{n} {w}" for w, n in skipped.items()) + ")"
        )
    return text


class PairSet:
    """A TokenSet of pairs (rows 2k, 2k + 1), seen pair by pair. `index` maps logical pairs to
    stored pairs (a split), sharing the rows."""

    packed = False

    def __init__(self, rows: RowTable, index: np.ndarray | None = None):
        self.ts, self.index = rows, index
        self.format, self.stats = rows.format, rows.stats

    def __len__(self) -> int:
        return len(self.ts) // 2 if self.index is None else len(self.index)

    @property
    def stored(self) -> np.ndarray:
        """(n,) the stored pair of each logical pair."""
        return np.arange(len(self.ts) // 2) if self.index is None else self.index

    def row_ids(self, pairs=None) -> np.ndarray:
        """The stored rows of `pairs` (default: all), chosen then rejected of each."""
        s = self.stored if pairs is None else self.stored[np.asarray(pairs, dtype=np.int64)]
        return np.stack([2 * s, 2 * s + 1], axis=1).reshape(-1)

    def rows(self, pairs) -> list[Row]:
        return self.ts.rows(self.row_ids(pairs))

    def select(self, pairs) -> PairSet:
        return PairSet(self.ts, self.stored[np.asarray(pairs, dtype=np.int64)])

    @property
    def num_tokens(self) -> int:
        return self.ts.select(self.row_ids()).num_tokens if self.index is not None else self.ts.num_tokens

    @property
    def label_tokens(self) -> int:
        return self.ts.select(self.row_ids()).label_tokens if self.index is not None else self.ts.label_tokens

    def desirable(self, pairs) -> np.ndarray:
        """(n,) bool: KTO examples (format `unpaired`): whether each is desirable."""
        return np.asarray(self.ts.stats["desirable"], dtype=bool)[
            self.stored[np.asarray(pairs, dtype=np.int64)]
        ]

    def summary(self) -> str:
        if self.format == "unpaired":
            return f"{len(self)} examples ({2 * len(self)} sequences with the mismatched ones), {self.num_tokens} tokens"
        return f"{len(self)} pairs ({2 * len(self)} sequences), {self.num_tokens} tokens, {self.label_tokens} with loss"

    def fingerprint(self) -> str:
        """Identity of the pairs as they are trained (tokens, labels, order, and the image tensors
        of pairs with images): what a stored reference was computed for."""
        h = hashlib.sha256(b"pairs")
        for r in self.ts.rows(self.row_ids()):
            h.update(np.int64(len(r.input_ids)).tobytes())
            h.update(np.ascontiguousarray(r.input_ids, np.int32).tobytes())
            h.update(np.ascontiguousarray(r.labels, np.int32).tobytes())
            for k, v in sorted((r.media or {}).items()):
                h.update(k.encode() + np.int64(v.size).tobytes() + np.ascontiguousarray(v).tobytes())
        return h.hexdigest()[:32]


def as_pairs(ts):
    """A preference TokenSet seen as pairs; any other set as it is."""
    return PairSet(ts) if isinstance(ts, TokenSet) and ts.format == "preference" else ts


def collate_pairs(
    rows: list[Row], micro_pairs: int, pad_id: int, ref: np.ndarray | None = None
) -> list[MicroBatch]:
    """Rows of a global batch of pairs (chosen, rejected, chosen, ...) -> micro-batches of
    `micro_pairs` whole pairs. ref: (pairs, 2) reference log-probs, or None."""
    mbs = collate(rows, 2 * micro_pairs, pad_id)
    chosen = rows[0::2]
    counts = {
        "pairs": len(rows) // 2,
        "chosen_tokens": sum(int((r.labels[1:] != IGNORE).sum()) for r in chosen),
        "chosen_seq_tokens": sum(max(len(r.input_ids) - 1, 0) for r in chosen),
    }
    flat = None if ref is None else torch.as_tensor(np.asarray(ref, np.float32).reshape(-1))
    off = 0
    for mb in mbs:
        b = mb.input_ids.shape[0]
        mb.payload = PairPayload(**counts, ref=None if flat is None else flat[off : off + b])
        off += b
    return mbs


@dataclass(frozen=True)
class PairPayload:
    """A micro-batch of pairs' payload (recipes.preference.loss reads it): the global batch's pairs,
    its chosen completions' label tokens (sft_weight's mean) and its chosen rows' predicted tokens
    (orpo's NLL mean); the rows' reference log-probs (b,) fp32 (dpo, cdpo, ipo), else None."""

    pairs: int
    chosen_tokens: int
    chosen_seq_tokens: int
    ref: torch.Tensor | None = None

    def unlabelled(self) -> PairPayload:
        return self  # the global batch's counts stay: the filler's pairs are invalid, adding nothing
