"""The data pipeline's entry point: `data:` config + tokenizer -> train and eval token sets.

    source (load raw records) -> formats/templates/encode (tokens + labels per example)
      -> truncate -> [pack] -> TokenSet -> cache -> eval split

The training loop then calls `sampler.batch_rows` and `collate.collate` per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from . import cache, source
from .batch import IGNORE
from .collate import pad_id_of
from .encode import EMPTY, NO_ASSISTANT, Encoder, Vocab, truncate
from .formats import columns_for, ignored_columns, resolve_format
from .pack import Packer
from .pairs import PairSet, as_pairs, build_pairs
from .tokset import RowBuilder, TokenSet

RECORDS_PER_BATCH = 1000  # records tokenized per tokenizer call
Log = Callable[[str], None]


@dataclass
class PreparedData:
    train: TokenSet | PairSet  # preference data: pairs (data.pairs)
    eval: TokenSet | PairSet | None
    format: str  # the format used (what `auto` chose)
    pad_id: int


def prepare_data(
    data_cfg,
    tokenizer,
    *,
    seed: int = 0,
    model_max_len: int | None = None,
    vocab_size: int | None = None,
    cache_dir: str | Path | None = None,
    log: Log = print,
) -> PreparedData:
    """Load, tokenize (or hit the cache), pack and split the `data:` section's datasets.

    vocab_size: the model's; every token id is checked against it. tokenizer may be None for
    format `tokens`. cache_dir is used when `data.cache_dir` is unset; with neither, nothing
    is cached.
    """
    check_lengths(data_cfg, model_max_len)
    root = data_cfg.cache_dir or cache_dir
    train = load_token_set(
        data_cfg.path,
        data_cfg,
        tokenizer,
        fmt=data_cfg.format,
        cache_dir=root,
        log=log,
        vocab_size=vocab_size,
    )
    evals = None
    if data_cfg.eval_path:
        evals = load_token_set(
            data_cfg.eval_path,
            data_cfg,
            tokenizer,
            fmt=train.format,
            cache_dir=root,
            log=log,
            what="data.eval_path",
            vocab_size=vocab_size,
        )
    train, evals = as_pairs(train), as_pairs(evals)  # preference: sampled and split pair by pair
    if evals is None and data_cfg.eval_fraction > 0:
        train, evals = split_eval(train, data_cfg.eval_fraction, seed)
    log(f"data: train: {train.summary()}")
    if evals is not None:
        how = data_cfg.eval_path or f"fraction {data_cfg.eval_fraction:g}, seed {seed}"
        log(f"data: eval ({how}): {evals.summary()}")
    return PreparedData(train, evals, train.format, pad_id_of(tokenizer, vocab_size))


def check_lengths(data_cfg, model_max_len: int | None) -> None:
    """Config-level checks that need no data."""
    if model_max_len and data_cfg.max_seq_len > model_max_len:
        raise InputError(
            f"data.max_seq_len: {data_cfg.max_seq_len} exceeds the model's limit of {model_max_len} positions"
        )
    if data_cfg.eval_path and data_cfg.eval_fraction > 0:
        raise InputError("data.eval_path: set data.eval_fraction or data.eval_path, not both")


def load_token_set(
    path: str,
    data_cfg,
    tokenizer,
    *,
    fmt: str,
    cache_dir=None,
    log: Log = print,
    what: str = "data.path",
    vocab_size: int | None = None,
) -> TokenSet:
    """One dataset -> a checked TokenSet, through the cache when `cache_dir` is set."""
    src = source.open_source(path, data_cfg.split, what)
    ds = None
    if src.key is None:  # hub: fingerprinted once loaded
        ds = source.load_records(src)
        src = source.Source(src.path, src.kind, src.split, source.hub_key(src, ds), src.what)
    entry, key = _entry(cache_dir, src, fmt, data_cfg, tokenizer, vocab_size)
    ts, problem = cache.load(entry, key) if entry else (None, None)
    if problem:
        log(f"data: {path}: note: the cached tokens {entry} {problem}; rebuilding them")
    if ts is not None:
        log(f"data: {path}: format {ts.format}; cache hit {entry}")
        _warn_ignored(ts.stats, ts.format, path, log)
        check_token_set(ts, path)
        return ts
    records = ds if ds is not None else source.load_records(src)
    ts = build_token_set(records, fmt, tokenizer, data_cfg, path, log, vocab_size)
    check_token_set(ts, path)
    if entry:
        cache.save(entry, ts, key)
        ts = cache.load(entry, key)[0] or ts  # the memory-mapped copy: identical to what a hit returns
    return ts


def build_token_set(
    ds, fmt: str, tokenizer, data_cfg, name: str, log: Log = print, vocab_size: int | None = None
) -> TokenSet:
    """Raw records -> examples (encoded, truncated, filtered) -> rows, packed or one per example."""
    if len(ds) == 0:
        raise InputError(f"{name}: the dataset is empty (no records)")
    chosen = resolve_format(fmt, list(ds.column_names), name)
    log(f"data: {name}: format {chosen}" + (" (auto-detected from its fields)" if fmt == "auto" else ""))
    if chosen == "preference":  # pairs: two rows each (data.pairs)
        return build_pairs(ds, tokenizer, data_cfg, name, log, _vocab("tokens", tokenizer, vocab_size))
    enc = Encoder(chosen, tokenizer, data_cfg.train_on_prompt, name, _vocab(chosen, tokenizer, vocab_size))
    read = columns_for(chosen, ds.column_names)
    stats: dict = {"records": 0, "examples": 0, EMPTY: 0, NO_ASSISTANT: 0, "no_labels": 0, "truncated": 0}
    rows = RowBuilder()
    packer = Packer(data_cfg.max_seq_len, rows) if data_cfg.packing else None
    for batch in ds.select_columns(read).iter(batch_size=RECORDS_PER_BATCH):
        for ex in enc.encode(batch, first=stats["records"] + 1):
            stats["records"] += 1
            _add(ex, packer or rows, data_cfg.max_seq_len, stats)
    if packer is not None:
        packer.flush()
    ts = rows.build(chosen, stats)
    ignored = ignored_columns(ds, read) + enc.notes
    stats.update(
        rows=len(ts), tokens=ts.num_tokens, label_tokens=ts.label_tokens, ignored_fields=dict(ignored)
    )
    log(f"data: {name}: {_describe(stats, data_cfg)}")
    _warn_ignored(stats, chosen, name, log)
    return ts


def split_eval(ts: TokenSet, fraction: float, seed: int) -> tuple[TokenSet, TokenSet]:
    """A seeded fraction of rows -> eval; the rest, in their order, -> train."""
    n = len(ts)
    n_eval = max(1, round(n * fraction))
    if n_eval >= n:
        raise InputError(f"data.eval_fraction: {fraction:g} of {n} rows leaves no rows to train on")
    rng = np.random.default_rng([seed, 0xE7A1])  # its own stream: independent of the sampler's
    chosen = rng.choice(n, size=n_eval, replace=False)
    is_eval = np.zeros(n, dtype=bool)
    is_eval[chosen] = True
    return ts.select(np.flatnonzero(~is_eval)), ts.select(np.flatnonzero(is_eval))


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


def _add(ex, sink, max_len: int, stats: dict) -> None:
    """Truncate one example and hand it to the row sink, or count why it was dropped."""
    if isinstance(ex, str):  # EMPTY or NO_ASSISTANT
        stats[ex] += 1
        if ex == NO_ASSISTANT:
            stats.setdefault("first_no_assistant", stats["records"])
        return
    ex, cut = truncate(ex, max_len)
    stats["truncated"] += int(cut)
    if not (ex[1][1:] != IGNORE).any():  # after the shift, nothing to predict
        stats["no_labels"] += 1
        return
    sink.add(*ex)
    stats["examples"] += 1


def _entry(
    cache_dir, src: source.Source, fmt: str, data_cfg, tokenizer, vocab_size: int | None
) -> tuple[Path | None, str]:
    if not cache_dir or src.key is None:
        return None, ""
    key = cache.cache_key(
        src.key,
        fmt,
        data_cfg.max_seq_len,
        data_cfg.packing,
        data_cfg.train_on_prompt,
        cache.tokenizer_fingerprint(tokenizer),
        vocab_size,
    )
    return cache.entry_dir(cache_dir, Path(src.path).stem, key), key


def _vocab(fmt: str, tokenizer, vocab_size: int | None) -> Vocab | None:
    """What ids are checked against: the model's vocabulary; for pre-tokenized data without a
    model at hand, the tokenizer's. (A tokenizer's own ids need no check against itself.)"""
    if vocab_size is not None:
        return Vocab(vocab_size, f"the model's vocabulary (vocab_size {vocab_size})")
    if fmt == "tokens" and tokenizer is not None:
        return Vocab(len(tokenizer), f"the tokenizer's vocabulary ({len(tokenizer)} tokens)")
    return None


def _warn_ignored(stats: dict, fmt: str, name: str, log: Log) -> None:
    """One line per field the format does not read that carries content somewhere."""
    for field, n in sorted(stats.get("ignored_fields", {}).items()):
        log(
            f"warning: {name}: field {field!r} is not read by format {fmt} "
            f"and is ignored (content in {n} record{'' if n == 1 else 's'})"
        )


def _describe(s: dict, data_cfg) -> str:
    text = f"{s['records']} records -> {s['examples']} examples"
    if data_cfg.packing:
        text += f" packed into {s['rows']} rows"
    text += f"; {s['tokens']} tokens, {s['label_tokens']} with loss"
    if s["truncated"]:
        text += f"; {s['truncated']} truncated to max_seq_len {data_cfg.max_seq_len}"
    dropped = s[EMPTY] + s[NO_ASSISTANT] + s["no_labels"]
    if dropped:
        text += f"; {dropped} dropped ({s[EMPTY]} empty, "
        if s[NO_ASSISTANT]:
            text += (
                f"{s[NO_ASSISTANT]} without an assistant turn (the first: record {s['first_no_assistant']}), "
            )
        text += f"{s['no_labels']} without loss tokens)"
    return text
