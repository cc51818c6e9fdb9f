"""Data stage 3a, building: one source's raw records -> its TokenSet, and what the summary says.

    records -> resolve the format -> Encoder (examples) -> rows: a `text` document longer than a
    row continues in the next rows (pack.pieces); other examples are truncated, and the records
    and tokens cut are counted -> packed or one row per example -> TokenSet (with its stats)

The fields no format reads are judged here (fields.py), once per source, before anything is
cached: the run stops on one that may change what a record means. Preference records are built
by data.pairs (two rows a pair, truncated as TRL does), judged the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import InputError
from .batch import IGNORE
from .encode import EMPTY, NO_ASSISTANT, Encoder, Vocab, truncate
from .fields import Unread, unread_columns
from .formats import columns_for, resolve_format
from .pack import Packer, pieces
from .pairs import build_pairs
from .tokset import RowBuilder, TokenSet
from .unpaired import build_unpaired_set

RECORDS_PER_BATCH = 1000  # records tokenized per tokenizer call
Log = Callable[[str], None]
COUNTERS = ("records", "examples", EMPTY, NO_ASSISTANT, "no_labels", "truncated", "cut_tokens",
            "cut_label_tokens", "split", "pieces")  # fmt: skip


def build_token_set(
    ds,
    fmt: str,
    tokenizer,
    data_cfg,
    name: str,
    log: Log = print,
    vocab_size: int | None = None,
    adapt: Callable[[dict], dict] | None = None,
) -> TokenSet:
    """Raw records -> examples (encoded, split or truncated, filtered) -> rows, packed or one per
    example. `adapt`: a function of a batch of columns applied before encoding (a registry's
    message tags)."""
    if len(ds) == 0:
        raise InputError(f"{name}: the dataset is empty (no records)")
    ignored_tags = {"kto_tag", "label"} & set(data_cfg.ignore_fields)  # declared metadata: not KTO
    chosen = resolve_format(fmt, [c for c in ds.column_names if c not in ignored_tags], name)
    if chosen == "prompt":  # read by data.prompt_only for an rl: run, never tokenized here
        raise InputError(
            f"{name}: holds prompts only (format prompt: no completion); train them online with an rl: section"
        )
    log(f"data: {name}: format {chosen}" + (" (auto-detected from its fields)" if fmt == "auto" else ""))
    if chosen == "preference":  # pairs: two rows each (data.pairs)
        ts = build_pairs(ds, tokenizer, data_cfg, name, log, _vocab("tokens", tokenizer, vocab_size), adapt)
        warn_ignored(ts.stats, chosen, name, log)
        return ts
    if chosen == "unpaired":  # KTO examples, one row each (data.unpaired)
        return build_unpaired_set(ds, tokenizer, data_cfg, name, log, adapt)
    ignore = frozenset(data_cfg.ignore_fields)
    read = columns_for(chosen, ds.column_names)
    ignored = unread_columns(ds, read, Unread(chosen, name, ignore))  # refuses meaning before any work
    enc = Encoder(
        chosen,
        tokenizer,
        data_cfg.train_on_prompt,
        name,
        _vocab(chosen, tokenizer, vocab_size),
        ignore=ignore,
    )
    stats: dict = dict.fromkeys(COUNTERS, 0)
    rows = RowBuilder()
    packer = Packer(data_cfg.max_seq_len, rows) if data_cfg.packing else None
    for batch in ds.select_columns(read).iter(batch_size=RECORDS_PER_BATCH):
        for ex in enc.encode(adapt(batch) if adapt else batch, first=stats["records"] + 1):
            stats["records"] += 1
            _add(ex, chosen == "text", packer, rows, data_cfg.max_seq_len, stats)
    if packer is not None:
        packer.flush()
    ts = rows.build(chosen, stats)
    ignored += enc.notes
    stats.update(
        rows=len(ts), tokens=ts.num_tokens, label_tokens=ts.label_tokens, ignored_fields=dict(ignored)
    )
    log(f"data: {name}: {describe(stats, data_cfg)}")
    warn_ignored(stats, chosen, name, log)
    return ts


def _add(ex, split: bool, packer: Packer | None, rows: RowBuilder, max_len: int, stats: dict) -> None:
    """One example -> rows: split (text) or truncated, or counted as dropped."""
    if isinstance(ex, str):  # EMPTY or NO_ASSISTANT
        stats[ex] += 1
        if ex == NO_ASSISTANT:
            stats.setdefault("first_no_assistant", stats["records"])
        return
    if split and len(ex[0]) > max_len:
        n = packer.add_long(*ex) if packer else _add_pieces(ex, rows, max_len)
        stats["split"] += 1
        stats["pieces"] += n
        stats["examples"] += 1
        return
    ids, labels = ex
    ex, cut = truncate(ex, max_len)
    if cut:
        stats["truncated"] += 1
        stats["cut_tokens"] += len(ids) - max_len
        stats["cut_label_tokens"] += int((labels[max_len:] != IGNORE).sum())
    if not (ex[1][1:] != IGNORE).any():  # after the shift, nothing to predict
        stats["no_labels"] += 1
        return
    (packer or rows).add(*ex)
    stats["examples"] += 1


def _add_pieces(ex, rows: RowBuilder, max_len: int) -> int:
    parts = pieces(ex[0], ex[1], max_len, max_len)
    for piece in parts:
        rows.add(*piece)
    return len(parts)


def check_token_set(ts: TokenSet, name: str) -> None:
    """Empty sets and sets without a single loss token are input errors, each saying why."""
    if len(ts) > 0 and ts.label_tokens > 0:
        return
    s = ts.stats
    records, no_turn = s.get("records", 0), s.get(NO_ASSISTANT, 0)
    if records == 0:
        raise InputError(f"{name}: the dataset is empty (no records)")
    if s.get(EMPTY, 0) == records:
        raise InputError(f"{name}: the dataset is empty: all {records} records are blank")
    if no_turn + s.get(EMPTY, 0) == records:
        who = f"record {s['first_no_assistant']} has no" if no_turn == 1 else "no record has an"
        raise InputError(
            f"{name}: {who} assistant turn, so there is nothing to train on "
            "(add assistant turns, or set data.train_on_prompt: true to train on every token)"
        )
    if ts.format == "tokens":
        hint = "the labels mark every token -100"
    else:
        hint = "set data.train_on_prompt: true to train on prompts too, or raise data.max_seq_len"
        if no_turn:
            hint += (
                f"; {no_turn} records have no assistant turn, the first is record {s['first_no_assistant']}"
            )
    raise InputError(f"{name}: every label is masked: no example has a token with loss ({hint})")


def warn_ignored(stats: dict, fmt: str, name: str, log: Log) -> None:
    """One line per field the format does not read that carries content somewhere."""
    for field, n in sorted(stats.get("ignored_fields", {}).items()):
        log(
            f"warning: {name}: field {field!r} is not read by format {fmt} "
            f"and is ignored (content in {n} record{'' if n == 1 else 's'})"
        )


def describe(s: dict, data_cfg) -> str:
    text = f"{s['records']} records -> {s['examples']} examples"
    if data_cfg.packing:
        text += f" packed into {s['rows']} rows"
    text += f"; {s['tokens']} tokens, {s['label_tokens']} with loss"
    if s.get("split"):
        text += (
            f"; {s['split']} documents longer than max_seq_len {data_cfg.max_seq_len} continue over "
            f"consecutive rows ({s['pieces']} pieces, none cut)"
        )
    if s["truncated"]:
        text += (
            f"; {s['truncated']} truncated to max_seq_len {data_cfg.max_seq_len} "
            f"({s.get('cut_tokens', 0)} tokens cut, {s.get('cut_label_tokens', 0)} of them with loss)"
        )
    dropped = s[EMPTY] + s[NO_ASSISTANT] + s["no_labels"]
    if dropped:
        text += f"; {dropped} dropped ({s[EMPTY]} empty, "
        if s[NO_ASSISTANT]:
            text += (
                f"{s[NO_ASSISTANT]} without an assistant turn (the first: record {s['first_no_assistant']}), "
            )
        text += f"{s['no_labels']} without loss tokens)"
    return text


def _vocab(fmt: str, tokenizer: Any, vocab_size: int | None) -> Vocab | None:
    """What ids are checked against: the model's vocabulary; for pre-tokenized data without a
    model at hand, the tokenizer's. (A tokenizer's own ids need no check against itself.)"""
    if vocab_size is not None:
        return Vocab(vocab_size, f"the model's vocabulary (vocab_size {vocab_size})")
    if fmt == "tokens" and tokenizer is not None:
        return Vocab(len(tokenizer), f"the tokenizer's vocabulary ({len(tokenizer)} tokens)")
    return None
