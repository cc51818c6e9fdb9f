"""Data stage 1, the source: find `data.path` and load its raw records through `datasets`.

A path is a local file (.jsonl / .json / .parquet / .csv / .txt, where each .txt line is a
`text` record), a `save_to_disk` directory (a Dataset, or a DatasetDict whose `data.split` is
used), or else a hub dataset name. `Source.key` fingerprints a local source from file metadata
alone, so a tokenization cache hit never has to import or read the dataset.

Text files must be UTF-8 (checked first, so a bad byte is named by line and offset; a leading
BOM is dropped, as in every input file), and CSV cells are read as the text they hold, never as
numbers.
"""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import utf8
from ..errors import InputError

# file suffix -> `datasets` packaged builder
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


@dataclass(frozen=True)
class Source:
    """Where records come from. kind: file | disk | hub; key: cache fingerprint (None for hub)."""

    path: str  # as the user wrote it (shown in messages)
    kind: str
    split: str
    key: dict | None
    what: str = "data.path"  # the config key that named it
    options: tuple[tuple[str, str], ...] = ()  # hub: load_dataset's name (subset) and data_dir (folder)


def open_source(path: str, split: str = "train", what: str = "data.path", options: tuple = ()) -> Source:
    """Classify `path` and fingerprint it; a missing local path is an InputError naming it."""
    if not path:
        raise InputError(f"{what}: not set (a data file, a save_to_disk directory or a hub name)")
    p = Path(path).expanduser()
    if p.is_dir():
        return Source(path, "disk", split, _disk_key(p, split, path), what)
    if p.is_file():
        if p.suffix.lower() not in BUILDERS:
            raise InputError(f"{path}: unsupported file type {p.suffix!r} (expected {', '.join(BUILDERS)})")
        if not os.access(p, os.R_OK):
            raise InputError(f"{path}: not readable (permission denied)")
        st = p.stat()
        if st.st_size == 0:
            raise InputError(f"{path}: the dataset is empty (the file has no bytes)")
        if split != "train":
            raise InputError(
                f"{what}: {path} is a single file, without splits; split {split!r} needs a DatasetDict "
                "(a save_to_disk directory or a hub dataset)"
            )
        key = {"file": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        return Source(path, "file", split, key, what)
    if p.suffix.lower() in BUILDERS or not HUB_NAME.fullmatch(path):
        raise InputError(f"{what}: {path}: no such file or directory")
    return Source(path, "hub", split, None, what, options)


def load_records(src: Source) -> Any:
    """Source -> `datasets.Dataset` of raw records (progress bars off while loading)."""
    import datasets

    bars_were_on = datasets.is_progress_bar_enabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # our InputError says it once
    try:
        if src.kind == "file":
            return _load_file(src.path)
        if src.kind == "disk":
            return _pick_split(datasets.load_from_disk(str(Path(src.path).expanduser())), src)
        return _load_hub(src)
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.enable_progress_bars()


def hub_key(src: Source, ds: Any) -> dict:
    """Cache fingerprint of a hub dataset, known only once it is loaded."""
    return {"hub": src.path, "split": src.split, "options": src.options, "fingerprint": ds._fingerprint}


def _load_file(path: str) -> Any:
    import datasets

    local = Path(path).expanduser()
    builder = BUILDERS[local.suffix.lower()]
    if builder != "parquet":  # `datasets` would fail deep inside a parser, naming neither line nor file
        utf8.check_file(local, path)
    options = _csv_as_text(local) if builder == "csv" else {}
    if builder == "text" and utf8.has_bom(local):  # else the first line would start with U+FEFF
        options["encoding"] = "utf-8-sig"  # (json and csv drop a BOM themselves)
    try:
        return datasets.load_dataset(builder, data_files=str(local), split="train", **options)
    except Exception as e:  # datasets wraps parser errors in several exception types
        if "corresponds to no data" in str(e):  # datasets' way to say: zero records (e.g. `[]`)
            raise InputError(f"{path}: the dataset is empty (no records)") from None
        raise InputError(f"{path}: cannot read as {builder}: {_root_cause(e)}") from None


def _csv_as_text(path: Path) -> dict:
    """Read every CSV cell as the text it holds: "0" stays "0", "4.50" stays "4.50" and an empty
    cell is "" (pandas would make numbers, 4.5, and NaN of them)."""
    import datasets

    with open(path, newline="", encoding="utf-8-sig") as f:  # pandas drops a BOM too
        header = next(csv.reader(f), [])
    if len(set(header)) != len(header):
        dup = next(h for h in header if header.count(h) > 1)
        raise InputError(f"{path}: the CSV header names column {dup!r} twice")
    features = datasets.Features({h: datasets.Value("string") for h in header})
    return {"features": features, "keep_default_na": False}


def _load_hub(src: Source) -> Any:
    import datasets
    import huggingface_hub.constants as hub

    try:
        return datasets.load_dataset(src.path, split=src.split, **dict(src.options))
    except Exception as e:
        if datasets.config.HF_HUB_OFFLINE or hub.HF_HUB_OFFLINE:
            raise InputError(
                f"{src.what}: {src.path}: not a local file or directory, and the hub is offline "
                "(HF_HUB_OFFLINE=1) so it cannot be loaded as a dataset name"
            ) from None
        raise InputError(
            f"{src.what}: {src.path}: not a local path; loading it from the hub failed: {_root_cause(e)}"
        ) from None


def _pick_split(ds: Any, src: Source) -> Any:
    """A DatasetDict -> its `split`; a Dataset as is."""
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        if src.split not in ds:
            raise InputError(
                f"{src.path}: no split {src.split!r} (splits: {', '.join(ds)}); set {_split_key(src)}"
            )
        return ds[src.split]
    return ds


def _split_key(src: Source) -> str:
    return "data.eval_split" if "eval_split" in src.what else "data.split"


def _disk_key(p: Path, split: str, path: str) -> dict:
    """Fingerprint a save_to_disk directory: datasets' own fingerprints plus its files' stats."""
    if (p / "dataset_dict.json").is_file():
        p = p / split
        if not (p / "state.json").is_file():
            splits = sorted(d.name for d in p.parent.iterdir() if (d / "state.json").is_file())
            raise InputError(f"{path}: no split {split!r} in this DatasetDict (splits: {', '.join(splits)})")
    elif not (p / "state.json").is_file():
        raise InputError(f"{path}: a directory, but not a datasets save_to_disk directory (no state.json)")
    try:
        fingerprint = json.loads((p / "state.json").read_text()).get("_fingerprint")
    except (OSError, ValueError) as e:
        raise InputError(f"{p / 'state.json'}: unreadable: {e}") from None
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in p.iterdir() if f.is_file())
    return {"dir": str(p.resolve()), "fingerprint": fingerprint, "files": files}


def _root_cause(e: BaseException) -> str:
    """First line of the first error in the chain not raised by `datasets` itself (the parser's)."""
    chain = [e]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 16:
        chain.append(nxt)
    cause = next((c for c in chain if not type(c).__module__.startswith("datasets")), chain[-1])
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0]}" if text else type(cause).__name__
