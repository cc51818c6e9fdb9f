"""The data pipeline's entry point: `data:` config + tokenizer -> train and eval token sets.

    catalog (the sources) -> per source: source (load raw records) -> build (formats, encode,
      split or truncate, [pack]) -> TokenSet -> cache -> [pairs] -> eval split -> mixture (weights)

Preference data (format `preference`) is seen pair by pair (data.pairs.PairSet) from the cache
on: the eval split, the mixture weights and the sampler count pairs and never part one.

The training loop then calls `sampler.batch_rows` and `collate.collate` per step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from . import cache, catalog, mixture, registry, source
from .build import build_token_set, check_token_set, warn_ignored
from .collate import pad_id_of
from .images import ImageData, first_with_images, refuse_images
from .mixture import MixedSet
from .pairs import PairSet, as_pairs
from .tokset import TokenSet
from .unpaired import kto_rows

Log = Callable[[str], None]
RowSet = TokenSet | MixedSet | PairSet  # PairSet: preference pairs, counted as pairs


@dataclass
class PreparedData:
    train: RowSet
    eval: RowSet | None
    format: str  # the format used (what `auto` chose; "chat+text" for a mixture of formats)
    pad_id: int

    @property
    def unit(self) -> str:
        """What len(train) counts: "pairs" (preference data) or "rows"."""
        return unit_of(self.train)

    def steps_for(self, epochs: float, batch_size: int) -> int:
        """Optimizer steps of `epochs` passes over the training rows (at least 1)."""
        return max(1, math.ceil(round(epochs * len(self.train) / batch_size, 9)))


def prepare_data(
    data_cfg,
    tokenizer,
    *,
    seed: int = 0,
    model_max_len: int | None = None,
    vocab_size: int | None = None,
    cache_dir: str | Path | None = None,
    log: Log = print,
    batch_size: int | None = None,
    images: ImageData | None = None,
) -> PreparedData:
    """Load, tokenize (or hit the cache), pack, split and mix the `data:` section's sources.

    vocab_size: the model's; every token id is checked against it. tokenizer may be None for
    format `tokens`. cache_dir is used when `data.cache_dir` is unset; with neither, nothing
    is cached. batch_size (the global batch): the summary says how many steps an epoch is.
    images: a multimodal model's image data (vision.imageset); None: records that name images
    are refused.
    """
    check_lengths(data_cfg, model_max_len)
    root = data_cfg.cache_dir or cache_dir
    specs = catalog.train_specs(data_cfg)

    def load(spec: catalog.Spec) -> TokenSet:
        return load_token_set(
            spec, data_cfg, tokenizer, cache_dir=root, log=log, vocab_size=vocab_size, images=images
        )

    def view(ts: TokenSet):  # pairs and KTO examples (two rows each) are seen pair by pair
        if ts.format == "unpaired":
            wrap = images.wrap if images is not None else None  # examples with images keep them
            return PairSet(kto_rows(ts, data_cfg.max_seq_len, batch_size or len(ts), wrap))
        return as_pairs(ts)

    parts = [view(load(s)) for s in specs]
    formats = sorted({p.format for p in parts})
    if "unpaired" in formats and (len(parts) > 1 or specs[0].weight != 1.0 or specs[0].num_samples):
        raise InputError(
            "data.path: unpaired preference (KTO) data trains from one source of weight 1 (the mismatched "
            "completions pair examples of one set)"
        )
    if "preference" in formats and len(formats) > 1:
        other = next(s.label for s, p in zip(specs, parts, strict=True) if p.format != "preference")
        raise InputError(
            f"data.path: {other} is format {next(f for f in formats if f != 'preference')}, and other "
            "sources hold preference pairs: a run trains on pairs or on sequences, not both"
        )
    eval_fmt = formats[0] if len(formats) == 1 else data_cfg.format
    evals = [view(load(s)) for s in catalog.eval_specs(data_cfg, specs, eval_fmt)]
    if data_cfg.eval_fraction > 0:
        pairs = [split_eval(p, data_cfg.eval_fraction, seed, k) for k, p in enumerate(parts)]
        parts, evals = [a for a, _ in pairs], [b for _, b in pairs]
    weights = [
        s.weight * (s.num_samples / p.stats["records"] if s.num_samples else 1.0)
        for s, p in zip(specs, parts, strict=True)
    ]
    train = mixture.mix(parts, weights, [s.label for s in specs], seed, log)
    ev = mixture.concat(evals)
    log(f"data: train: {train.summary()}" + epoch_text(len(train), batch_size, unit_of(train)))
    if ev is not None:
        how = data_cfg.eval_path or (
            f"split {data_cfg.eval_split!r}"
            if data_cfg.eval_split
            else f"fraction {data_cfg.eval_fraction:g}, seed {seed}"
        )
        log(f"data: eval ({how}): {ev.summary()}")
    if batch_size and batch_size > len(train):
        unit = unit_of(train)
        log(
            f"data: note: the global batch (train.batch_size {batch_size}) is larger than the training set "
            f"({len(train)} {unit}): every step holds some {unit} more than once"
        )
    return PreparedData(train, ev, train.format, pad_id_of(tokenizer, vocab_size))


def epoch_text(rows: int, batch_size: int | None, what: str = "rows") -> str:
    if not batch_size:
        return ""
    unit = "step" if rows == batch_size else "steps"
    return f"; an epoch is {rows} {what} = {rows / batch_size:g} {unit} of train.batch_size {batch_size}"


def unit_of(rows) -> str:
    if isinstance(rows, PairSet):
        return "examples" if rows.format == "unpaired" else "pairs"
    return "rows"


def check_lengths(data_cfg, model_max_len: int | None) -> None:
    """Config-level checks that need no data."""
    if model_max_len and data_cfg.max_seq_len > model_max_len:
        raise InputError(
            f"data.max_seq_len: {data_cfg.max_seq_len} exceeds the model's limit of {model_max_len} positions"
        )
    given = [k for k in ("eval_path", "eval_fraction", "eval_split") if getattr(data_cfg, k, None)]
    if len(given) > 1:
        raise InputError(
            f"data.{given[1]}: give one of data.eval_path, eval_fraction and eval_split, not several"
        )


def load_token_set(
    spec: catalog.Spec,
    data_cfg,
    tokenizer,
    *,
    cache_dir=None,
    log: Log = print,
    vocab_size: int | None = None,
    images: ImageData | None = None,
) -> TokenSet:
    """One source -> a checked TokenSet, through the cache when `cache_dir` is set. `images`:
    a multimodal model's image data, which builds a source whose records name images."""
    path = spec.path
    src = source.open_source(path, spec.split, spec.what, spec.hub_options)
    ds = None
    if images is not None:  # records with images: built by the model's processor (vision.imageset)
        ds = source.load_records(src)
        named = _as_horizon(ds, spec, path)[0]  # a registry's columns renamed first ("images": "pics")
        if first_with_images(named) is not None:
            return _image_set(named, src, spec, data_cfg, tokenizer, images, cache_dir, log, vocab_size)
    if src.key is None:  # hub: fingerprinted once loaded
        ds = source.load_records(src)
        src = source.Source(src.path, src.kind, src.split, source.hub_key(src, ds), src.what, src.options)
    entry, key = _entry(cache_dir, src, spec, data_cfg, tokenizer, vocab_size)
    ts, problem = cache.load(entry, key) if entry else (None, None)
    if problem:
        log(f"data: {path}: note: the cached tokens {entry} {problem}; rebuilding them")
    if ts is not None:
        log(f"data: {path}: format {ts.format}; cache hit {entry}")
        warn_ignored(ts.stats, ts.format, path, log)
        check_token_set(ts, path)
        return ts
    records = ds if ds is not None else source.load_records(src)
    records, fmt, adapt = _as_horizon(records, spec, path)
    if images is None:  # under the registry's names, as the image check above reads them
        refuse_images(records, path, "the model")
    ts = build_token_set(records, fmt, tokenizer, data_cfg, path, log, vocab_size, adapt)
    check_token_set(ts, path)
    if entry:
        cache.save(entry, ts, key)
        ts = cache.load(entry, key)[0] or ts  # the memory-mapped copy: identical to what a hit returns
    return ts


def _image_set(ds, src, spec, data_cfg, tokenizer, images: ImageData, cache_dir, log: Log, vocab_size):
    """A source whose records (under the registry's names) name images: through the cache, keyed
    on the images' content too."""
    path = spec.path
    base = Path(src.path).parent if src.kind == "file" else Path(src.path)
    entry, key = _entry(cache_dir, src, spec, data_cfg, tokenizer, vocab_size) if src.key else (None, "")
    more = images.key(ds, data_cfg, base) if entry else None
    if entry is not None and more is not None:
        key = hashlib.sha256(f"{key}:{more}".encode()).hexdigest()[:20]
        entry = entry.with_name(entry.name + "-img")
        ts, problem = cache.load(entry, key, images.wrap)
        if problem:
            log(f"data: {path}: note: the cached tokens {entry} {problem}; rebuilding them")
        if ts is not None:
            log(f"data: {path}: format {ts.format} with images; cache hit {entry}")
            check_token_set(ts, path)
            return ts
    ts = images.build(ds, data_cfg, path, log, base)
    check_token_set(ts, path)
    if entry is not None and more is not None:
        cache.save(entry, ts, key)
        ts = cache.load(entry, key, images.wrap)[0] or ts
    return ts


def _as_horizon(ds, spec: catalog.Spec, name: str):
    """A registry entry's records under horizon's field names: (records, format, batch adapter)."""
    fmt, rename = spec.format, dict(spec.rename)
    if spec.text_column and "output" not in ds.column_names and spec.text_column in ds.column_names:
        fmt, rename[spec.text_column] = "text", "text"  # LLaMA-Factory's pre-training shape
    rename = {a: b for a, b in rename.items() if a in ds.column_names}
    clash = next((b for a, b in rename.items() if b in ds.column_names and b not in rename), None)
    if clash:
        raise InputError(f"{name}: {spec.what} maps a column to {clash!r}, which the data already has")
    if rename:
        ds = ds.rename_columns(rename)
    adapt = registry.retag(spec.tags, "conversations", "chosen", "rejected") if spec.tags else None
    return ds, fmt, adapt


def split_eval(ts, fraction: float, seed: int, part: int = 0):
    """A seeded fraction of rows (of a PairSet: pairs) -> eval; the rest, in their order, ->
    train. `part`: the source's index (each source is split on its own stream)."""
    n, unit = len(ts), unit_of(ts)
    n_eval = max(1, round(n * fraction))
    if n_eval >= n:
        raise InputError(f"data.eval_fraction: {fraction:g} of {n} {unit} leaves no {unit} to train on")
    stream = [seed, 0xE7A1] if part == 0 else [seed, 0xE7A1, part]
    rng = np.random.default_rng(stream)  # its own stream: independent of the sampler's
    chosen = rng.choice(n, size=n_eval, replace=False)
    is_eval = np.zeros(n, dtype=bool)
    is_eval[chosen] = True
    return ts.select(np.flatnonzero(~is_eval)), ts.select(np.flatnonzero(is_eval))


def _template_kwargs(data_cfg) -> dict:
    """data.chat_template_kwargs in the cache key, when given (keys without them stay as they were)."""
    kw = data_cfg.chat_template_kwargs
    return {"chat_template_kwargs": dict(kw)} if kw else {}


def _entry(
    cache_dir, src: source.Source, spec: catalog.Spec, data_cfg, tokenizer, vocab_size: int | None
) -> tuple[Path | None, str]:
    if not cache_dir or src.key is None:
        return None, ""
    key = cache.cache_key(
        src.key,
        spec.format,
        data_cfg.max_seq_len,
        data_cfg.packing,
        data_cfg.train_on_prompt,
        cache.tokenizer_fingerprint(tokenizer),
        vocab_size,
        reading={
            **spec.mapping,
            "ignore_fields": sorted(data_cfg.ignore_fields),
            **_template_kwargs(data_cfg),
        },
    )
    return cache.entry_dir(cache_dir, Path(src.path).stem, key), key
