"""Data stage 2a', the fields no format reads: metadata, text to warn about, or meaning to refuse.

A field that the chosen format does not read (a top-level column, or a key of a chat message)
is one of three things, decided in this order:

    metadata   ignored silently: named in `data.ignore_fields` (the user says so), named like an
               id, provenance or a statistic (META_FIELDS: `id`, `source`, `url`, `token_count`,
               ...), or holding nothing but nulls and blank strings
    meaning    refused, naming the field and the first record: named like a tag, label, weight,
               score or reward (MEANING_FIELDS), whatever it holds, or holding a number or a
               boolean anywhere. Such a field changes what a record teaches (LLaMA-Factory's
               `kto_tag: false` and TRL's `label: false` mark a response to avoid; a `weight`
               or `score` asks for a weighted loss), so training on the record as plain SFT
               would be silently wrong. `kto_tag`, and a boolean `label` on a record with a
               response, are unpaired preference (KTO) data (format unpaired, which `auto`
               picks): read with another format named, they say so.
    text       anything else with content (a non-blank string, a non-empty list or object):
               named in one warning line per field, with the number of records that hold it

A field in `data.ignore_fields` may name a top-level field (`score`) or a message field, bare
(`train`) or as the warning shows it (`messages[].train`).
"""

from __future__ import annotations

import numbers
from collections import Counter
from dataclasses import dataclass

from ..errors import InputError

# fields that never carry training text or meaning: ids, provenance, statistics (compared lower-case)
META_FIELDS = frozenset(
    ("id", "idx", "index", "uid", "uuid", "key", "hash", "md5", "sha256", "source", "sources", "dataset",
     "dataset_name", "subset", "split", "url", "license", "meta", "metadata", "timestamp", "created_at",
     "date", "lang", "language", "category", "task", "tags", "prompt_id", "conversation_id", "dump",
     "file_path", "token_count", "num_tokens", "n_tokens", "length", "word_count", "char_count",
     "num_turns", "turn_count", "language_score")
)  # fmt: skip
# fields whose value changes what a record means, whatever type it has (compared lower-case)
MEANING_FIELDS = frozenset(
    ("kto_tag", "label", "labels", "weight", "weights", "score", "scores", "reward", "rewards",
     "advantage", "advantages", "rating", "ratings", "rank", "ranking", "preference", "preferred",
     "chosen", "rejected", "train", "training")
)  # fmt: skip
KTO = "unpaired preference (KTO) data is trained by preference: {loss: kto} with data.format unpaired or auto"
MEDIA_FEATURES = ("Image", "Audio", "Video", "Pdf", "Nifti")  # `datasets` features decoded on read


@dataclass(frozen=True)
class Unread:
    """How to judge the fields a format does not read: `ignore` (data.ignore_fields), `fmt` (the
    format, for messages) and `name` (the dataset, for messages)."""

    fmt: str
    name: str
    ignore: frozenset[str] = frozenset()

    def is_metadata(self, field: str, shown: str | None = None) -> bool:
        return field.lower() in META_FIELDS or field in self.ignore or (shown or field) in self.ignore

    def check(self, field: str, value: object, where: str, shown: str | None = None) -> bool:
        """One value of a field no format reads: True when it carries text to warn about; an
        InputError when it carries meaning. `shown`: how a message field is named (messages[].x)."""
        if value is None or self.is_metadata(field, shown):
            return False
        if meaningful(field, value):
            raise InputError(refusal(shown or field, value, where, self.fmt))
        return carries_content(value)


def meaningful(field: str, value: object) -> bool:
    """A value that may change what a record means: a meaning name with any non-blank value, or
    a number or boolean under any name."""
    if field.lower() in MEANING_FIELDS:
        return value is not None and (carries_content(value) or not isinstance(value, str | list | dict))
    return isinstance(value, bool | numbers.Number)


def refusal(field: str, value: object, where: str, fmt: str) -> str:
    shown = repr(value) if not isinstance(value, bool) else str(value).lower()
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    bare = field.rsplit(".", 1)[-1].lower()
    paired = fmt in ("prompt_completion", "chat", "instruction")  # a response the tag may judge
    if bare == "kto_tag" or (bare == "label" and isinstance(value, bool) and paired):
        return (
            f"{where}: field {field!r} ({shown}) marks the response desirable or not: {KTO} (to train "
            f"on every record as plain SFT anyway, list {field!r} in data.ignore_fields)"
        )
    return (
        f"{where}: field {field!r} holds {shown}, which may change what the record means (a tag, label, "
        f"weight, score or reward) and format {fmt} does not read it; remove the field, or list it "
        "in data.ignore_fields to train without it"
    )


def carries_content(value: object) -> bool:
    """A non-blank string or a non-empty list or object (numbers and booleans are judged apart)."""
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, list | tuple | dict):
        return len(value) > 0
    return False


def unread_columns(ds, read: list[str], unread: Unread, batch_size: int = 1000) -> Counter:
    """Columns of `ds` (a datasets.Dataset) that the format does not read -> records where they
    carry text; an InputError for the first value that carries meaning. Media columns (images,
    audio) are counted from arrow, without decoding."""
    counts: Counter = Counter()
    other = [c for c in ds.column_names if c not in read and not unread.is_metadata(c)]
    media = [c for c in other if _has_media(ds.features[c])]
    for c in media:
        counts[c] = _nonempty_rows(ds.data.column(c))
    plain = [c for c in other if c not in media]
    if plain:
        first = 1
        for batch in ds.select_columns(plain).iter(batch_size=batch_size):
            for c in plain:
                for i, v in enumerate(batch[c]):
                    counts[c] += unread.check(c, v, f"{unread.name}: record {first + i}")
            first += len(batch[plain[0]])
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
