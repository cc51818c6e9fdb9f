"""Data stage 2d', prompt/completion records (TRL's SFT format) -> (input_ids, labels).

As TRL's SFTTrainer tokenizes them (with `completion_only_loss`, its default for this format):

    strings        prompt_ids = tokenizer(prompt); ids = tokenizer(prompt + completion + EOS)
                   (EOS appended unless the completion ends with it)
    message lists  prompt_ids = chat template of the prompt with the generation prompt;
                   ids = chat template of prompt + completion (both tokenized without adding
                   special tokens: the template writes them)

The loss is on every token of `ids` after the longest common prefix of prompt_ids and ids (the
completion, its end-of-turn marker and whatever the template writes after it); with
`train_on_prompt`, on every token. Message lists are read and checked as chat records are
(records.turns_of, templates.check_rendered): a template that drops something stops the run.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ..errors import InputError
from . import templates
from .batch import IGNORE
from .fields import Unread
from .records import Chat, text_of, tools_of, turns_of

Example = tuple[np.ndarray, np.ndarray]
EMPTY = "empty"


def encode_records(
    tokenizer, records: list[dict], wheres: list[str], notes: Counter, judge: Unread, train_on_prompt: bool
) -> list[Example | str]:
    """A batch of prompt/completion records -> an Example each, or EMPTY (a blank completion)."""
    pairs = [_texts(tokenizer, r, w, notes, judge) for r, w in zip(records, wheres, strict=True)]
    todo = {i: p for i, p in enumerate(pairs) if not isinstance(p, str)}
    encoded: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for conversational in (False, True):  # strings get the tokenizer's special tokens, templates write theirs
        idx = [i for i in todo if _is_conv(records[i]) == conversational]
        encoded.update(
            zip(idx, _tokenize(tokenizer, [todo[i] for i in idx], not conversational), strict=True)
        )
    out: list[Example | str] = []
    for i, p in enumerate(pairs):
        if isinstance(p, str):
            out.append(p)
            continue
        prompt_ids, ids = encoded[i]
        labels = ids.copy()
        labels[: 0 if train_on_prompt else _common_prefix(prompt_ids, ids)] = IGNORE
        out.append((ids, labels))
    return out


def _is_conv(record: dict) -> bool:
    return isinstance(record.get("prompt"), list)


def _texts(tokenizer, r: dict, where: str, notes: Counter, judge: Unread) -> tuple[str, str] | str:
    """(prompt text, prompt + completion text), rendered; EMPTY for a blank completion."""
    prompt, completion = r.get("prompt"), r.get("completion")
    if isinstance(prompt, list) != isinstance(completion, list):
        raise InputError(
            f"{where}: prompt and completion must both be text or both be message lists "
            f"(got {_kind(prompt)} and {_kind(completion)})"
        )
    if not isinstance(prompt, list):
        p, c = text_of(prompt, "prompt", where), text_of(completion, "completion", where)
        if not c.strip():
            return EMPTY
        eos = tokenizer.eos_token
        return p, p + c + (eos if eos and not c.endswith(eos) else "")
    before, w1 = turns_of(prompt, "prompt", where, notes, judge)
    after, w2 = turns_of(completion, "completion", where, notes, judge)
    if not after or not any(m["content"].strip() or m.get("tool_calls") for m in after):
        return EMPTY
    if 0 in w1 + w2:
        raise InputError(
            f"{where}: a message weight of 0 is read in chat data only (here the completion is trained)"
        )
    if templates.chat_template_of(tokenizer) is None:
        raise InputError(
            "tokenizer: prompt/completion message lists need a chat template, and this tokenizer has none"
        )
    tools = tools_of(r.get("tools"), where)
    full = templates.render(tokenizer, before + after, False, where, tools)
    templates.check_rendered(tokenizer, Chat(before + after, tools), full, where)
    return templates.render(tokenizer, before, True, where, tools), full


def _tokenize(
    tokenizer, pairs: list[tuple[str, str]], add_special: bool
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt text, full text) pairs -> (prompt ids, full ids), in two tokenizer calls."""
    if not pairs:
        return []
    kw = {"add_special_tokens": add_special, "verbose": False}
    prompts = tokenizer([p for p, _ in pairs], **kw)["input_ids"]
    fulls = tokenizer([f for _, f in pairs], **kw)["input_ids"]
    return [(np.asarray(a, np.int32), np.asarray(b, np.int32)) for a, b in zip(prompts, fulls, strict=True)]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Leading tokens a and b share: where the completion starts (TRL's common_prefix_length)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _kind(v: object) -> str:
    return "a list" if isinstance(v, list) else "text" if isinstance(v, str) else type(v).__name__
