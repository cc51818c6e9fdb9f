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
from .encode import encode_batch, truncate
from .formats import columns_for, resolve_format
from .pack import Packer
from .tokset import RowBuilder, TokenSet

RECORDS_PER_BATCH = 1000  # records tokenized per tokenizer call
Log = Callable[[str], None]


@dataclass
class PreparedData:
    train: TokenSet
    eval: TokenSet | None
    format: str  # the format used (what `auto` chose)
    pad_id: int


def prepare_data(
    data_cfg,
    tokenizer,
    *,
    seed: int = 0,
    model_max_len: int | None = None,
    cache_dir: str | Path | None = None,
    log: Log = print,
) -> PreparedData:
    """Load, tokenize (or hit the cache), pack and split the `data:` section's datasets.

    cache_dir is used when `data.cache_dir` is unset; with neither, nothing is cached.
    """
    check_lengths(data_cfg, model_max_len)
    root = data_cfg.cache_dir or cache_dir
    train = load_token_set(data_cfg.path, data_cfg, tokenizer, fmt=data_cfg.format, cache_dir=root, log=log)
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
        )
    elif data_cfg.eval_fraction > 0:
        train, evals = split_eval(train, data_cfg.eval_fraction, seed)
    log(f"data: train: {train.summary()}")
    if evals is not None:
        how = data_cfg.eval_path or f"fraction {data_cfg.eval_fraction:g}, seed {seed}"
        log(f"data: eval ({how}): {evals.summary()}")
    return PreparedData(train, evals, train.format, pad_id_of(tokenizer))


def check_lengths(data_cfg, model_max_len: int | None) -> None:
    """Config-level checks that need no data."""
    if model_max_len and data_cfg.max_seq_len > model_max_len:
        raise InputError(
            f"data.max_seq_len: {data_cfg.max_seq_len} exceeds the model's limit of {model_max_len} positions"
        )
    if data_cfg.eval_path and data_cfg.eval_fraction > 0:
        raise InputError("data.eval_path: set data.eval_fraction or data.eval_path, not both")


def load_token_set(
    path: str, data_cfg, tokenizer, *, fmt: str, cache_dir=None, log: Log = print, what: str = "data.path"
) -> TokenSet:
    """One dataset -> a checked TokenSet, through the cache when `cache_dir` is set."""
    src = source.open_source(path, data_cfg.split, what)
    ds = None
    if src.key is None:  # hub: fingerprinted once loaded
        ds = source.load_records(src)
        src = source.Source(src.path, src.kind, src.split, source.hub_key(src, ds), src.what)
    entry = _entry(cache_dir, src, fmt, data_cfg, tokenizer)
    ts = cache.load(entry) if entry else None
    if ts is not None:
        log(f"data: {path}: format {ts.format}; cache hit {entry}")
        check_token_set(ts, path)
        return ts
    ts = build_token_set(
        ds if ds is not None else source.load_records(src), fmt, tokenizer, data_cfg, path, log
    )
    check_token_set(ts, path)
    if entry:
        cache.save(entry, ts)
        ts = cache.load(entry) or ts  # the memory-mapped copy: identical to what a hit returns
    return ts


def build_token_set(ds, fmt: str, tokenizer, data_cfg, name: str, log: Log = print) -> TokenSet:
    """Raw records -> examples (encoded, truncated, filtered) -> rows, packed or one per example."""
    if len(ds) == 0:
        raise InputError(f"{name}: the dataset is empty (no records)")
    chosen = resolve_format(fmt, list(ds.column_names), name)
    log(f"data: {name}: format {chosen}" + (" (auto-detected from its fields)" if fmt == "auto" else ""))
    stats = {"records": 0, "examples": 0, "empty": 0, "no_labels": 0, "truncated": 0}
    rows = RowBuilder()
    packer = Packer(data_cfg.max_seq_len, rows) if data_cfg.packing else None
    for batch in ds.select_columns(columns_for(chosen, ds.column_names)).iter(batch_size=RECORDS_PER_BATCH):
        base = stats["records"]
        for ex in encode_batch(chosen, batch, tokenizer, data_cfg.train_on_prompt, _where(name, base)):
            stats["records"] += 1
            _add(ex, packer or rows, data_cfg.max_seq_len, stats)
    if packer is not None:
        packer.flush()
    ts = rows.build(chosen, stats)
    stats.update(rows=len(ts), tokens=ts.num_tokens, label_tokens=ts.label_tokens)
    log(f"data: {name}: {_describe(stats, data_cfg)}")
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
    """Empty sets and sets without a single loss token are input errors."""
    if len(ts) > 0 and ts.label_tokens > 0:
        return
    s = ts.stats
    if s.get("records", 0) == 0:
        raise InputError(f"{name}: the dataset is empty (no records)")
    if s.get("no_labels", 0) == 0:
        raise InputError(f"{name}: the dataset is empty: all {s['records']} records are blank")
    hint = (
        "the labels mark every token -100"
        if ts.format == "tokens"
        else "set data.train_on_prompt: true to train on prompts too, or raise data.max_seq_len"
    )
    raise InputError(f"{name}: every label is masked: no example has a token with loss ({hint})")


def _add(ex, sink, max_len: int, stats: dict) -> None:
    """Truncate one example and hand it to the row sink, or count why it was dropped."""
    if ex is None:
        stats["empty"] += 1
        return
    ex, cut = truncate(ex, max_len)
    stats["truncated"] += int(cut)
    if not (ex[1][1:] != IGNORE).any():  # after the shift, nothing to predict
        stats["no_labels"] += 1
        return
    sink.add(*ex)
    stats["examples"] += 1


def _entry(cache_dir, src: source.Source, fmt: str, data_cfg, tokenizer) -> Path | None:
    if not cache_dir or src.key is None:
        return None
    key = cache.cache_key(
        src.key,
        fmt,
        data_cfg.max_seq_len,
        data_cfg.packing,
        data_cfg.train_on_prompt,
        cache.tokenizer_fingerprint(tokenizer),
    )
    return cache.entry_dir(cache_dir, Path(src.path).stem, key)


def _where(name: str, base: int) -> Callable[[int], str]:
    return lambda i: f"{name}: record {base + i + 1}"


def _describe(s: dict, data_cfg) -> str:
    text = f"{s['records']} records -> {s['examples']} examples"
    if data_cfg.packing:
        text += f" packed into {s['rows']} rows"
    text += f"; {s['tokens']} tokens, {s['label_tokens']} with loss"
    if s["truncated"]:
        text += f"; {s['truncated']} truncated to max_seq_len {data_cfg.max_seq_len}"
    dropped = s["empty"] + s["no_labels"]
    if dropped:
        text += f"; {dropped} dropped ({s['empty']} empty, {s['no_labels']} without loss tokens)"
    return text
