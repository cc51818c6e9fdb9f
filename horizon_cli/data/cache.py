"""Data stage 3c, the tokenization cache: a TokenSet on disk, keyed by everything that shapes it.

Key = sha256 of (source fingerprint: file path + size + mtime, or the save_to_disk
fingerprint; format; max_seq_len; packing; train_on_prompt; tokenizer identity; the model's
vocab size, which the token ids were checked against; how the records are read: a registry's
column names and tags, data.ignore_fields; CACHE_VERSION).
An entry is a directory `<cache_dir>/<stem>-<key>/` of flat .npy arrays (tokens, labels,
offsets, optional doc_ids) and meta.json (the key, each array's shape, dtype and CRC32), written
under a temporary name and renamed into place, so a reader never sees half an entry. A load
checks the key and every checksum, so a corrupt or mismatched entry is refused (and rebuilt by
the caller), never used. Loads are memory-mapped: a hit is bit-identical to the set stored.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .templates import chat_template_of
from .tokset import TokenSet

# 2: checksums and key in meta.json; system/history/tools rendered; 3: long text split, cuts counted;
# 4: an alpaca record's instruction and input joined by one newline (LLaMA-Factory's rule), a
# .txt file's BOM dropped
CACHE_VERSION = 4
CRC_CHUNK = 64 << 20
ARRAYS = ("tokens", "labels", "offsets", "doc_ids")
Wrap = Callable[[TokenSet, dict, dict], TokenSet]  # a TokenSet and its media -> the set with them


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
    source_key: dict,
    fmt: str,
    max_seq_len: int,
    packing: bool,
    train_on_prompt: bool,
    tok_fp: str,
    vocab: int | None = None,
    reading: dict | None = None,
) -> str:
    parts = {
        "reading": reading or {},
        "vocab": vocab,
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


def load(entry: Path, key: str, wrap: Wrap | None = None) -> tuple[TokenSet | None, str | None]:
    """(the stored TokenSet, None), or (None, why the entry cannot be used), or (None, None) on a miss.

    The entry must carry `key` (its fingerprint) and every array its stored shape, dtype and
    CRC32: a corrupt or mismatched entry is never used. Arrays are memory-mapped read-only.
    An entry with media (image tensors: `media.<name>`, `media_offsets.<name>`) is given back
    through `wrap` (vision.imageset); without one it is a miss.
    """
    if not entry.exists():
        return None, None
    try:
        meta = json.loads((entry / "meta.json").read_text())
        if meta.get("version") != CACHE_VERSION:
            return None, f"was written by another version (cache format {meta.get('version')})"
        if meta.get("key") != key:
            return None, "does not match its fingerprint (its key differs)"
        arrays = {}
        for name, want in meta["arrays"].items():
            arr = np.load(entry / f"{name}.npy", mmap_mode="r")
            if [list(arr.shape), str(arr.dtype), _crc(arr)] != [want["shape"], want["dtype"], want["crc32"]]:
                return None, f"is corrupt ({name}.npy does not match its checksum)"
            arrays[name] = arr
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"is unreadable ({type(e).__name__}: {e})"
    if not {"tokens", "labels", "offsets"} <= arrays.keys():
        return None, "is incomplete"
    ts = TokenSet(arrays["tokens"], arrays["labels"], arrays["offsets"], arrays.get("doc_ids"))
    ts.format, ts.stats = meta["format"], meta["stats"]
    names = meta.get("media", [])
    if names:
        if wrap is None:
            return None, None
        media = {n: arrays[f"media.{n}"] for n in names}
        ts = wrap(ts, media, {n: arrays[f"media_offsets.{n}"] for n in names})
    return ts, None


def save(entry: Path, ts: TokenSet, key: str) -> None:
    """Write `ts` (whole stored arrays; no view index) under a temp name, then rename into place."""
    assert ts.index is None, "cache whole token sets, not views"
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        stored = {}
        media = getattr(ts, "media", None) or {}
        extra = {f"media.{n}": a for n, a in media.items()}
        extra.update({f"media_offsets.{n}": a for n, a in getattr(ts, "media_offsets", {}).items()})
        for name in (*ARRAYS, *extra):
            arr = extra[name] if name in extra else getattr(ts, name)
            if arr is not None:
                arr = np.ascontiguousarray(arr)
                np.save(tmp / f"{name}.npy", arr)
                stored[name] = {"shape": list(arr.shape), "dtype": str(arr.dtype), "crc32": _crc(arr)}
        meta = {
            "version": CACHE_VERSION,
            "key": key,
            "format": ts.format,
            "stats": ts.stats,
            "arrays": stored,
            "media": sorted(media),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if entry.exists():  # stale or broken entry (load() refused it): replace it
            shutil.rmtree(entry, ignore_errors=True)
        os.rename(tmp, entry)
    except OSError:
        if load(entry, key)[0] is not None:
            return  # another process stored the same entry first
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _crc(arr: np.ndarray) -> int:
    """CRC32 of an array's bytes, a chunk at a time (the array may be a memory map)."""
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    crc = 0
    for i in range(0, len(flat), CRC_CHUNK):
        crc = zlib.crc32(flat[i : i + CRC_CHUNK].data, crc)
    return crc
