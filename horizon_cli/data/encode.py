"""Data stage 2d, tokenization: a batch of raw records -> (input_ids, labels) per example.

Labels are aligned with input_ids as in transformers (the engine shifts them): a token's label
is itself where it carries loss, IGNORE where it does not.

    text         tokenizer's special tokens (BOS if it adds one) + text, + EOS unless already there;
                 loss on every token
    instruction  chat template with the prompt as a user turn (after `system` and `history`), or
                 the Alpaca prompt (+ BOS) then output + EOS; loss on the responses (and their end
                 marker) unless train_on_prompt
    chat         chat template rendering (it writes BOS and end-of-turn markers itself);
                 loss on assistant turns (except those with weight 0) unless train_on_prompt
    prompt_completion  as TRL's SFTTrainer (completion.py): loss on the completion
    tokens       input_ids exactly as given; labels as given or a copy of input_ids

Character spans from `templates` become token labels through the fast tokenizer's offsets: a
token carries loss when its characters overlap a span. Every id must be inside the model's
vocabulary: an id beyond it would index past the embedding.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError
from . import completion, templates
from .batch import IGNORE
from .fields import Unread
from .records import chat_record, instruction_record, text_of
from .templates import Rendered

Example = tuple[np.ndarray, np.ndarray]  # (input_ids (L,) int32, labels (L,) int32)
EMPTY, NO_ASSISTANT = "empty", "no_assistant"  # why a record gives no example


@dataclass(frozen=True)
class Vocab:
    """Token ids must lie in [0, size); `what` names where the size comes from, for messages."""

    size: int
    what: str


class NoTokenizer(InputError):
    """The data needs a tokenizer and none was given. Worded without knowing what model.path is;
    the caller that does (train.loop.load_data) names it."""

    def __init__(self, fmt: str, hint: str = ""):
        self.fmt, self.hint = fmt, hint or ONLY_TOKENS  # hint: what works without one
        super().__init__(f"model.path: no tokenizer files, and format {fmt!r} needs a tokenizer{self.hint}")


ONLY_TOKENS = " (only format 'tokens' works without one)"


@dataclass
class Encoder:
    """Encodes the records of one dataset (`name`) in the format `fmt`.

    `encode` gives per record an Example, or the reason it gives none (EMPTY, NO_ASSISTANT);
    `notes` counts, per record, the message fields that were ignored; `ignore` names the fields
    that are metadata (data.ignore_fields; fields.py).
    """

    fmt: str
    tokenizer: Any
    train_on_prompt: bool
    name: str
    vocab: Vocab | None = None
    notes: Counter = field(default_factory=Counter)
    ignore: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.fmt != "tokens" and self.tokenizer is None:
            raise NoTokenizer(self.fmt)
        self._gen_prompt: bool | None = None
        self.judge = Unread(self.fmt, self.name, self.ignore)

    def where(self, record: int) -> str:
        return f"{self.name}: record {record}"

    def encode(self, batch: dict[str, list], first: int) -> list[Example | str]:
        """Columns of a batch of records, the first being record number `first` (from 1)."""
        n = len(next(iter(batch.values())))
        records = [{k: v[i] for k, v in batch.items()} for i in range(n)]
        wheres = [self.where(first + i) for i in range(n)]
        if self.fmt == "tokens":
            return [self._tokens(r, w) for r, w in zip(records, wheres, strict=True)]
        if self.fmt == "prompt_completion":
            out = completion.encode_records(
                self.tokenizer, records, wheres, self.notes, self.judge, self.train_on_prompt
            )
        else:
            out = self._encode_rendered(records, first)
        for ex, w in zip(out, wheres, strict=True):
            if not isinstance(ex, str):
                self._check_ids(ex[0], w)
        return out

    def _encode_rendered(self, records: list[dict], first: int) -> list[Example | str]:
        rendered, add_special, add_eos = self._render(records, first)
        if self.train_on_prompt:
            rendered = [r if isinstance(r, str) else Rendered(r.text, None) for r in rendered]
        todo = [r for r in rendered if not isinstance(r, str)]
        encoded = iter(encode_rendered(self.tokenizer, todo, add_special, add_eos))
        return [r if isinstance(r, str) else next(encoded) for r in rendered]

    def _render(self, records: list[dict], first: int) -> tuple[list[Rendered | str], bool, bool]:
        """text / instruction / chat records -> (Rendered or a drop reason, add_special, add_eos)."""
        tok = self.tokenizer
        if self.fmt == "text":
            texts = [text_of(r.get("text"), "text", self.where(first + i)) for i, r in enumerate(records)]
            return [Rendered(t, None) if t.strip() else EMPTY for t in texts], True, True
        has_template = templates.chat_template_of(tok) is not None
        if self.fmt == "instruction" and not has_template:
            ins = [instruction_record(r, self.where(first + i)) for i, r in enumerate(records)]
            return [templates.alpaca(x) for x in ins], True, True
        if not has_template:
            raise InputError(
                "tokenizer: format 'chat' needs a chat template, and this tokenizer has none "
                "(use format instruction or text, or a tokenizer with chat_template)"
            )
        if self._gen_prompt is None:
            self._gen_prompt = templates.has_generation_prompt(tok)
        out: list[Rendered | str] = []
        for i, r in enumerate(records):
            where = self.where(first + i)
            if self.fmt == "chat":
                conv = chat_record(r, where, self.notes, self.judge)
            else:
                conv = instruction_record(r, where).as_chat()
            if not conv.messages:
                out.append(EMPTY)
            elif not conv.has_assistant and not self.train_on_prompt:
                out.append(NO_ASSISTANT)
            else:
                out.append(templates.chat(tok, conv, where, self._gen_prompt))
        return out, False, False

    def _tokens(self, record: dict, where: str) -> Example | str:
        """Pre-tokenized record, used exactly as given (checked: ints, in vocab, labels aligned)."""
        ids = _int_array(record.get("input_ids"), "input_ids", where)
        if len(ids) == 0:
            return EMPTY
        self._check_ids(ids, where, "input_ids")
        mask = record.get("attention_mask")
        if mask is not None and not (np.asarray(mask) == 1).all():
            raise InputError(
                f"{where}: attention_mask has zeros; horizon attends to every token of a record "
                "(remove the padding; mark positions without loss with label -100)"
            )
        if record.get("labels") is None:
            return ids, ids.copy()
        labels = _int_array(record["labels"], "labels", where)
        if len(labels) != len(ids):
            raise InputError(
                f"{where}: labels has {len(labels)} entries, input_ids {len(ids)}; they must align"
            )
        self._check_ids(labels[labels != IGNORE], where, "labels")
        return ids, labels

    def _check_ids(self, ids: np.ndarray, where: str, field: str | None = None) -> None:
        """Every id in [0, vocab): a bad one names the record, the field and the vocabulary."""
        v = self.vocab
        if v is None or len(ids) == 0 or (ids.min() >= 0 and ids.max() < v.size):
            return
        bad = int(ids[(ids < 0) | (ids >= v.size)][0])
        if field is None:  # ids made by the tokenizer: it does not belong to this model
            token = self.tokenizer.convert_ids_to_tokens(bad)
            raise InputError(
                f"{where}: the tokenizer gives id {bad} ({token!r}), outside {v.what} "
                "(the tokenizer does not match the model)"
            )
        hint = " (-100 marks positions without loss in labels, not in input_ids)" if bad == IGNORE else ""
        raise InputError(f"{where}: {field} holds id {bad}, outside {v.what}{hint}")


def encode_rendered(tokenizer, rendered: list[Rendered], add_special: bool, add_eos: bool) -> list[Example]:
    """Tokenize rendered texts in one call; spans -> labels; optionally append a trainable EOS."""
    if not rendered:
        return []
    need_offsets = any(r.spans is not None for r in rendered)
    if need_offsets and not getattr(tokenizer, "is_fast", False):
        raise InputError("tokenizer: masking the prompt needs a fast tokenizer (tokenizer.json)")
    enc = tokenizer(
        [r.text for r in rendered],
        add_special_tokens=add_special,
        return_offsets_mapping=need_offsets,
        verbose=False,
    )
    eos = tokenizer.eos_token_id if add_eos else None
    out = []
    for k, r in enumerate(rendered):
        ids = np.asarray(enc["input_ids"][k], dtype=np.int32)
        labels = ids.copy() if r.spans is None else _span_labels(ids, enc["offset_mapping"][k], r.spans)
        if eos is not None and (len(ids) == 0 or ids[-1] != eos):
            ids, labels = np.append(ids, np.int32(eos)), np.append(labels, np.int32(eos))
        out.append((ids, labels))
    return out


def truncate(ex: Example, max_len: int) -> tuple[Example, bool]:
    """Drop tokens beyond max_len; says whether any were dropped."""
    ids, labels = ex
    if len(ids) <= max_len:
        return ex, False
    return (ids[:max_len], labels[:max_len]), True


def _span_labels(ids: np.ndarray, offsets: list, spans: list[tuple[int, int]]) -> np.ndarray:
    """Token t carries loss when its characters [s, e) overlap a span.  (L,) -> (L,)."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)  # (L, 2)
    hit = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        hit |= (off[:, 0] < b) & (off[:, 1] > a)
    return np.where(hit, ids, np.int32(IGNORE)).astype(np.int32)


def _int_array(value, field: str, where: str) -> np.ndarray:
    """A flat list of integers -> (L,) int32, checked before the cast (no silent wrap-around)."""
    if value is None:
        return np.zeros(0, dtype=np.int32)
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):
        arr = np.asarray([None])
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InputError(f"{where}: {field} must be a flat list of integers")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise InputError(f"{where}: {field} holds an id beyond 32 bits")
    return arr.astype(np.int32)
