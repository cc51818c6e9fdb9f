"""Data stage 3c, the tokenization cache: a TokenSet on disk, keyed by everything that shapes it.

Key = sha256 of (source fingerprint: file path + size + mtime, or the save_to_disk
fingerprint; format; max_seq_len; packing; train_on_prompt; tokenizer identity; CACHE_VERSION).
An entry is a directory `<cache_dir>/<stem>-<key>/` of flat .npy arrays (tokens, labels,
offsets, optional doc_ids) and meta.json, written under a temporary name and renamed into
place, so a reader never sees half an entry. Loads are memory-mapped: a hit is fast and
bit-identical to the set that was stored.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from .templates import chat_template_of
from .tokset import TokenSet

CACHE_VERSION = 1
ARRAYS = ("tokens", "labels", "offsets", "doc_ids")


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what decides token ids: the backend's full JSON (vocab, merges, normalizer,
    post-processor, added tokens) or else the vocabulary, plus special tokens and chat template.
    `tokens` data needs no tokenizer: None hashes as such."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    if tokenizer is None:
        return h.hexdigest()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update(json.dumps(chat_template_of(tokenizer), sort_keys=True).encode())
    return h.hexdigest()


def cache_key(
    source_key: dict, fmt: str, max_seq_len: int, packing: bool, train_on_prompt: bool, tok_fp: str
) -> str:
    parts = {
        "version": CACHE_VERSION,
        "source": source_key,
        "format": fmt,
        "max_seq_len": max_seq_len,
        "packing": packing,
        "train_on_prompt": train_on_prompt,
        "tokenizer": tok_fp,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def entry_dir(cache_dir: str | Path, stem: str, key: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)[:40] or "data"
    return Path(cache_dir) / f"{safe}-{key}"


def load(entry: Path) -> TokenSet | None:
    """The stored TokenSet (arrays memory-mapped read-only), or None on a miss or a stale entry."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        if meta.get("version") != CACHE_VERSION:
            return None
        tokens, labels, offsets, doc_ids = (
            np.load(entry / f"{name}.npy", mmap_mode="r") if name in meta["arrays"] else None
            for name in ARRAYS
        )
    except (OSError, ValueError, KeyError):
        return None
    if tokens is None or labels is None or offsets is None:
        return None
    return TokenSet(tokens, labels, offsets, doc_ids, format=meta["format"], stats=meta["stats"])


def save(entry: Path, ts: TokenSet) -> None:
    """Write `ts` (whole stored arrays; no view index) under a temp name, then rename into place."""
    assert ts.index is None, "cache whole token sets, not views"
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        stored = []
        for name in ARRAYS:
            arr = getattr(ts, name)
            if arr is not None:
                np.save(tmp / f"{name}.npy", np.ascontiguousarray(arr))
                stored.append(name)
        meta = {"version": CACHE_VERSION, "format": ts.format, "stats": ts.stats, "arrays": stored}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if entry.exists():  # stale or broken entry (load() refused it): replace it
            shutil.rmtree(entry, ignore_errors=True)
        os.rename(tmp, entry)
    except OSError:
        if entry.exists() and load(entry) is not None:
            return  # another process stored the same entry first
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
