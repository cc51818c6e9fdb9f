"""Data sources from LLaMA-Factory's registry: `dataset_info.json` -> one source per entry.

An entry names its data (`file_name`, relative to the registry's directory, or `hf_hub_url` with
optional `subset`, `folder` and `split`), its `formatting` (alpaca -> instruction, or text when
it maps only a prompt column, LLaMA-Factory's pre-training shape; sharegpt -> chat; `ranking:
true` -> preference), its `columns` (LLaMA-Factory's names -> the dataset's) and, for sharegpt,
its message `tags`. The columns are renamed to horizon's names (`prompt` -> instruction, `query`
-> input, `response` -> output, `messages` -> conversations, ...); a column the entry does not
map keeps its name and is read or judged as usual; an entry whose `columns` name a `kto_tag` is
unpaired preference (KTO) data (format unpaired).
Messages with other tags are rewritten to ShareGPT's from/value with its role names (tags that
name OpenAI's role/content keys and roles leave the messages as they are, tool calls and all).
`num_samples` scales the source's share of the mixture (num_samples / records of its rows).
Entries that load from elsewhere (ModelScope, scripts, cloud storage) are refused, as are keys
LLaMA-Factory does not define (a typo would silently drop a mapping).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .. import utf8
from ..errors import InputError

FILE = "dataset_info.json"
WHERE = ("file_name", "hf_hub_url")
ELSEWHERE = ("ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
KEYS = frozenset((*WHERE, *ELSEWHERE, "file_sha1", "formatting", "ranking", "subset", "split", "folder",
                  "num_samples", "columns", "tags"))  # fmt: skip
# LLaMA-Factory column name -> horizon's field, per formatting
COLUMNS = {
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output", "history": "history",
               "system": "system", "tools": "tools", "images": "images", "videos": "videos",
               "audios": "audios", "chosen": "chosen", "rejected": "rejected", "kto_tag": "kto_tag"},
    "sharegpt": {"messages": "conversations", "system": "system", "tools": "tools", "images": "images",
                 "videos": "videos", "audios": "audios", "chosen": "chosen", "rejected": "rejected",
                 "kto_tag": "kto_tag"},
}  # fmt: skip
# sharegpt tag -> (LLaMA-Factory's default, the ShareGPT role horizon reads)
TAGS = {"role_tag": ("from", None), "content_tag": ("value", None), "user_tag": ("human", "human"),
        "assistant_tag": ("gpt", "gpt"), "observation_tag": ("observation", "observation"),
        "function_tag": ("function_call", "function_call"), "system_tag": ("system", "system")}  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One registry entry as a source: where, in which format, and how its columns map."""

    name: str
    path: str  # a local path or a hub name
    format: str
    split: str = "train"
    rename: tuple[tuple[str, str], ...] = ()  # (dataset column, horizon field)
    tags: tuple[tuple[str, str], ...] = ()  # sharegpt tags that differ from the defaults
    text_column: str | None = None  # alpaca mapping a prompt but no response: text if the data has no output
    num_samples: int | None = None
    hub_options: tuple[tuple[str, str], ...] = ()  # subset / folder of a hub dataset


def is_registry(path: str) -> bool:
    return Path(path).name == FILE and Path(path).is_file()


def read_registry(path: str, names: list[str] | None, what: str) -> list[Entry]:
    """The entries of `path` (all, in file order, or those `names` lists), checked."""
    try:
        info = json.loads(utf8.read_text(path))
    except (OSError, ValueError) as e:
        raise InputError(f"{what}: {path}: unreadable as a dataset registry ({e})") from None
    if (
        not isinstance(info, dict)
        or not info
        or not all(isinstance(v, dict) and any(k in v for k in (*WHERE, *ELSEWHERE)) for v in info.values())
    ):
        raise InputError(
            f"{what}: {path}: not a LLaMA-Factory dataset registry (an object of entries, each with "
            "file_name or hf_hub_url)"
        )
    wanted = list(info) if names is None else names
    unknown = [n for n in wanted if n not in info]
    if unknown:
        raise InputError(f"{what}: {path} has no entry {unknown[0]!r} (entries: {', '.join(info)})")
    if not wanted:
        raise InputError(f"{what}: names: an empty list (give at least one entry of {path})")
    root = Path(path).parent
    return [_entry(n, info[n], root, f"{path}: entry {n!r}") for n in wanted]


def _entry(name: str, e: dict, root: Path, where: str) -> Entry:
    bad = sorted(set(e) - KEYS)
    if bad:
        raise InputError(f"{where}: unknown key {bad[0]!r} (LLaMA-Factory defines {', '.join(sorted(KEYS))})")
    formatting = e.get("formatting", "alpaca")
    if formatting not in COLUMNS:
        raise InputError(f"{where}: formatting {formatting!r} (expected alpaca or sharegpt)")
    rename = _rename(e.get("columns") or {}, formatting, where)
    if "hf_hub_url" in e:
        path = str(e["hf_hub_url"])
        hub = tuple((k, str(e[v])) for k, v in (("name", "subset"), ("data_dir", "folder")) if e.get(v))
    elif "file_name" in e:
        path, hub = str(root / str(e["file_name"])), ()
        if e.get("subset") or e.get("folder"):
            raise InputError(f"{where}: subset and folder are for hf_hub_url entries, not file_name")
    else:
        raise InputError(
            f"{where}: loads from {', '.join(k for k in ELSEWHERE if k in e)}, which horizon does not "
            "read; give file_name (a local file) or hf_hub_url"
        )
    fmt = "preference" if e.get("ranking") else "chat" if formatting == "sharegpt" else "instruction"
    cols = e.get("columns") or {}
    if not e.get("ranking") and cols.get("kto_tag"):  # mapped to itself too (its own entries)
        fmt = "unpaired"  # LLaMA-Factory's KTO data: a kto_tag column (data.unpaired)
    # LLaMA-Factory's pre-training entry maps only the prompt ({"columns": {"prompt": "text"}})
    text = (
        str(cols["prompt"]) if fmt == "instruction" and "prompt" in cols and "response" not in cols else None
    )
    n = e.get("num_samples")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise InputError(f"{where}: num_samples must be a positive integer, got {n!r}")
    tags = _tags(e.get("tags"), formatting, where)
    return Entry(name, path, fmt, str(e.get("split") or "train"), rename, tags, text, n, hub)


def _rename(columns: object, formatting: str, where: str) -> tuple[tuple[str, str], ...]:
    """(dataset column, horizon field) for every column the entry maps to another name."""
    if not isinstance(columns, dict):
        raise InputError(f"{where}: columns must be an object of column names")
    known = COLUMNS[formatting]
    bad = [k for k in columns if k not in known]
    if bad:
        raise InputError(f"{where}: columns: {bad[0]!r} is not a {formatting} column ({', '.join(known)})")
    return tuple((str(col), known[lf]) for lf, col in columns.items() if col and str(col) != known[lf])


def _tags(tags: object, formatting: str, where: str) -> tuple[tuple[str, str], ...]:
    if tags in (None, {}):
        return ()
    if formatting != "sharegpt" or not isinstance(tags, dict):
        raise InputError(f"{where}: tags are for sharegpt entries: an object of tag names")
    bad = [k for k in tags if k not in TAGS]
    if bad:
        raise InputError(f"{where}: tags: unknown tag {bad[0]!r} ({', '.join(TAGS)})")
    changed = {k: str(v) for k, v in tags.items() if v != TAGS[k][0]}
    if _openai_shaped({k: v for k, (v, _) in TAGS.items()} | changed):
        return ()  # OpenAI messages as they are: read by role/content, tool calls and all
    return tuple(changed.items())


def _openai_shaped(t: dict[str, str]) -> bool:
    """Tags that name OpenAI's keys and roles, which the chat reader takes as they are."""
    same = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
            "system_tag": "system"}  # fmt: skip
    return all(t[k] == v for k, v in same.items()) and t["observation_tag"] in ("observation", "tool")


def retag(tags: tuple[tuple[str, str], ...], *columns: str):
    """A batch function rewriting the turns of `columns` from an entry's tags to ShareGPT's
    from/value (other keys of a turn are kept, so that they are judged as usual). A column may
    hold a list of turns or one turn (a ranking entry's chosen and rejected)."""
    t = {k: v for k, (v, _) in TAGS.items()} | dict(tags)
    roles = {t[k]: role for k, (_, role) in TAGS.items() if role}

    def turn(m: object) -> object:
        if not isinstance(m, dict):
            return m
        rest = {k: v for k, v in m.items() if k not in (t["role_tag"], t["content_tag"], "from", "value")}
        role = m.get(t["role_tag"])
        return {"from": roles.get(str(role), role), "value": m.get(t["content_tag"]), **rest}

    def one(ts: object) -> object:
        return [turn(m) for m in ts] if isinstance(ts, list) else turn(ts)

    def apply(batch: dict) -> dict:
        return {**batch, **{c: [one(ts) for ts in batch[c]] for c in columns if c in batch}}

    return apply
