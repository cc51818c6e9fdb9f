"""Data stage 2a, formats: which fields a format reads, `auto` detection, the fields it ignores.

    text         {"text": str}
    instruction  {"instruction", "input" (optional), "output"}  (Alpaca), optional LLaMA-Factory
                 "system" and "history" [[prompt, response], ...]
    chat         {"messages": [{"role", "content", ...}, ...]}
                 or sharegpt {"conversations": [{"from", "value"}, ...]}; optional "system", "tools"
    tokens       {"input_ids": [int], "labels": [int] (optional, -100 = no loss)}, optional
                 "attention_mask" (all ones: horizon never pads inside a record)
    preference   {"chosen", "rejected"} with "prompt", "instruction" or "conversations" (or an
                 implicit prompt), or pre-tokenized {"prompt_input_ids", "chosen_input_ids",
                 "rejected_input_ids"}: pairs, read by data.preference

`auto` picks the first format whose fields are present, in the order tokens, preference, chat,
instruction, text (the most specific first: a pre-tokenized set may also carry its `text`, a
preference pair its `conversations` or `instruction`).

Any other field is reported once (by `ignored_columns`) when it carries content: a non-blank
string or a non-empty list or object. Numbers, booleans, nulls and blanks are metadata, and so is
any field named in META_FIELDS (ids, provenance), so they are ignored silently.
"""

from __future__ import annotations

from collections import Counter

from ..errors import InputError

FORMATS = ("text", "instruction", "chat", "tokens", "preference")
DETECT = ("tokens", "preference", "chat", "instruction", "text")  # `auto`, in order

# format -> groups of fields; each group needs one of its alternatives
REQUIRED: dict[str, tuple[tuple[str, ...], ...]] = {
    "tokens": (("input_ids",),),
    "preference": (("chosen", "chosen_input_ids"), ("rejected", "rejected_input_ids")),
    "chat": (("messages", "conversations"),),
    "instruction": (("instruction",), ("output",)),
    "text": (("text",),),
}
OPTIONAL = {
    "tokens": ("labels", "attention_mask"),
    "instruction": ("input", "system", "history"),
    "chat": ("system", "tools"),
    "text": (),
    "preference": (
        "prompt",
        "prompt_input_ids",
        "instruction",
        "input",
        "conversations",
        "system",
        "history",
        "tools",
    ),
}
# fields that never carry training text: ids and provenance (compared lower-case)
META_FIELDS = frozenset(
    ("id", "idx", "index", "uid", "uuid", "key", "hash", "md5", "sha256", "source", "sources", "dataset",
     "dataset_name", "subset", "split", "url", "license", "meta", "metadata", "timestamp", "created_at",
     "date", "lang", "language", "category", "task", "tags")
)  # fmt: skip
MEDIA_FEATURES = ("Image", "Audio", "Video", "Pdf", "Nifti")  # `datasets` features decoded on read


def resolve_format(fmt: str, columns: list[str], name: str) -> str:
    """Configured format (or `auto`) + the dataset's fields -> the format to use, checked."""
    half = [f for f in ("chosen", "rejected") if f in columns]
    if fmt in ("auto", "preference") and len(half) == 1:  # one completion of a pair
        other = "rejected" if half == ["chosen"] else "chosen"
        raise InputError(
            f"{name}: has field {half[0]!r} but no {other!r}: a preference pair needs both completions"
        )
    if fmt == "auto":
        for cand in DETECT:
            if _has_fields(cand, columns):
                return cand
        raise InputError(
            f"{name}: cannot detect the data format from fields [{', '.join(columns)}]; expected text, "
            "instruction+output, messages or conversations, chosen+rejected, or input_ids (or set data.format)"
        )
    if fmt not in FORMATS:
        raise InputError(
            f"data.format: unknown format {fmt!r} (expected auto or one of {', '.join(FORMATS)})"
        )
    if not _has_fields(fmt, columns):
        need = " and ".join("/".join(group) for group in REQUIRED[fmt])
        raise InputError(
            f"{name}: format {fmt!r} needs field(s) {need}; the data has fields [{', '.join(columns)}]"
        )
    return fmt


def columns_for(fmt: str, columns: list[str]) -> list[str]:
    """The dataset columns a format reads (only these are pulled out of arrow). A chat set with
    both `messages` and `conversations` reads `messages`."""
    groups = [tuple(f for f in group if f in columns)[:1] for group in REQUIRED[fmt]]
    wanted = {f for group in groups for f in group} | set(OPTIONAL[fmt])
    return [c for c in columns if c in wanted]


def carries_content(value: object) -> bool:
    """A non-blank string or a non-empty list or object (numbers and booleans are metadata)."""
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, list | tuple | dict):
        return len(value) > 0
    return False


def ignored_columns(ds, read: list[str], batch_size: int = 1000) -> Counter:
    """Columns of `ds` (a datasets.Dataset) that no format field reads -> records where they
    carry content. Media columns (images, audio) are counted from arrow, without decoding."""
    counts: Counter = Counter()
    other = [c for c in ds.column_names if c not in read and c.lower() not in META_FIELDS]
    media = [c for c in other if _has_media(ds.features[c])]
    for c in media:
        counts[c] = _nonempty_rows(ds.data.column(c))
    plain = [c for c in other if c not in media]
    if plain:
        for batch in ds.select_columns(plain).iter(batch_size=batch_size):
            for c in plain:
                counts[c] += sum(map(carries_content, batch[c]))
    return +counts  # drop zero counts


def _has_media(feature) -> bool:
    if type(feature).__name__ in MEDIA_FEATURES:
        return True
    if isinstance(feature, dict):
        return any(_has_media(f) for f in feature.values())
    inner = getattr(feature, "feature", None)  # List, LargeList, Sequence
    return inner is not None and _has_media(inner)


def _nonempty_rows(col) -> int:
    """Rows of an arrow column that are not null (and, for lists, not empty)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        return int(pc.sum(pc.greater(pc.list_value_length(col), 0)).as_py() or 0)
    return len(col) - col.null_count


def _has_fields(fmt: str, columns: list[str]) -> bool:
    return all(any(f in columns for f in group) for group in REQUIRED[fmt])
