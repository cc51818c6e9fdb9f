"""Data stage 2c, tokenization: a batch of raw records -> (input_ids, labels) per example.

Labels are aligned with input_ids as in transformers (the engine shifts them): a token's label
is itself where it carries loss, IGNORE where it does not.

    text         tokenizer's special tokens (BOS if it adds one) + text, + EOS unless already there;
                 loss on every token
    instruction  chat template with the prompt as a user turn, or the Alpaca prompt (+ BOS) then
                 output + EOS; loss on the response (and its end marker) unless train_on_prompt
    chat         chat template rendering (it writes BOS and end-of-turn markers itself);
                 loss on assistant turns unless train_on_prompt
    tokens       input_ids exactly as given; labels as given or a copy of input_ids

Character spans from `templates` become token labels through the fast tokenizer's offsets: a
token carries loss when its characters overlap a span.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import InputError
from . import templates
from .batch import IGNORE
from .formats import chat_messages, instruction_prompt
from .templates import Rendered

Example = tuple[np.ndarray, np.ndarray]  # (input_ids (L,) int32, labels (L,) int32)
Where = Callable[[int], str]  # record index within the batch -> "file: record N"


def encode_batch(
    fmt: str, batch: dict[str, list], tokenizer, train_on_prompt: bool, where: Where
) -> list[Example | None]:
    """Columns of one batch of records -> one Example per record, None for an empty record."""
    n = len(next(iter(batch.values())))
    records = [{k: v[i] for k, v in batch.items()} for i in range(n)]
    if fmt == "tokens":
        return [_tokens(r, len(tokenizer), where(i)) for i, r in enumerate(records)]
    rendered, add_special, add_eos = _render(fmt, records, tokenizer, where)
    if train_on_prompt:
        rendered = [None if r is None else Rendered(r.text, None) for r in rendered]
    todo = [r for r in rendered if r is not None]
    encoded = iter(encode_rendered(tokenizer, todo, add_special, add_eos))
    return [None if r is None else next(encoded) for r in rendered]


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


def _render(
    fmt: str, records: list[dict], tokenizer, where: Where
) -> tuple[list[Rendered | None], bool, bool]:
    """text / instruction / chat records -> (Rendered or None per record, add_special, add_eos)."""
    if fmt == "text":
        texts = [r.get("text") for r in records]
        return [Rendered(t, None) if isinstance(t, str) and t.strip() else None for t in texts], True, True
    has_template = templates.chat_template_of(tokenizer) is not None
    if fmt == "instruction" and not has_template:
        return [templates.alpaca(r) for r in records], True, True
    if not has_template:
        raise InputError(
            "tokenizer: format 'chat' needs a chat template, and this tokenizer has none "
            "(use format instruction or text, or a tokenizer with chat_template)"
        )
    gen_prompt = templates.has_generation_prompt(tokenizer)
    out: list[Rendered | None] = []
    for i, r in enumerate(records):
        msgs = chat_messages(r, where(i)) if fmt == "chat" else _instruction_messages(r)
        out.append(templates.chat(tokenizer, msgs, where(i), gen_prompt) if msgs else None)
    return out, False, False


def _instruction_messages(record: dict) -> list[dict]:
    """An alpaca record as one user turn and the assistant's reply."""
    prompt, response = instruction_prompt(record)
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def _tokens(record: dict, vocab: int, where: str) -> Example | None:
    """Pre-tokenized record, used exactly as given (checked: ints, in vocab, labels aligned)."""
    ids = _int_array(record.get("input_ids"), "input_ids", where)
    if len(ids) == 0:
        return None
    if ids.min() < 0 or ids.max() >= vocab:
        raise InputError(f"{where}: input_ids holds ids outside the tokenizer's vocabulary [0, {vocab})")
    if record.get("labels") is None:
        return ids, ids.copy()
    labels = _int_array(record["labels"], "labels", where)
    if len(labels) != len(ids):
        raise InputError(f"{where}: labels has {len(labels)} entries, input_ids {len(ids)}; they must align")
    return ids, labels


def _int_array(value, field: str, where: str) -> np.ndarray:
    if value is None:
        return np.zeros(0, dtype=np.int32)
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):
        arr = np.asarray([None])
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InputError(f"{where}: {field} must be a flat list of integers")
    return arr.astype(np.int32)
