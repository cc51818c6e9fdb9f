"""Data stage 2e, preference pairs: a record -> (prompt, chosen, rejected) token ids, as TRL's
DPOTrainer tokenizes them (trl/trainer/dpo_trainer.py, `_prepare_dataset`).

    TRL standard        prompt, chosen, rejected: strings; the tokenizer's EOS is appended to each
                        completion that does not end with it; prompt and prompt + completion are
                        tokenized (special tokens added, as the tokenizer adds them)
    TRL conversational  prompt: messages; chosen, rejected: assistant message lists; the chat
                        template renders prompt (with the generation prompt) and prompt + completion
    TRL implicit prompt chosen and rejected only (strings or messages): their shared beginning is
                        the prompt (TRL's extract_prompt)
    LLaMA-Factory alpaca     instruction, input, chosen, rejected (strings); optional system, history
                             (rendered as a conversation with a chat template, else the Alpaca prompt)
    LLaMA-Factory sharegpt   conversations (the prompt's turns), chosen, rejected: one message each;
                             optional system, tools
    pre-tokenized       prompt_input_ids, chosen_input_ids, rejected_input_ids: used as given

The completion starts where the tokenized prompt and prompt + completion part (TRL's
`common_prefix_length`, over both completions). A record whose completion is missing (null) is an
error; one whose chosen equals its rejected, or with an empty completion, is skipped and named
(data.pairs turns pairs into rows, truncated as TRL's collator does).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError
from . import templates
from .encode import Vocab, _int_array
from .fields import Unread
from .records import SHAREGPT_ROLES, chat_record, instruction_record, text_of, tools_of, turns_of

TOKENS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
# form -> the fields it reads (the first listed decide the form, in this order)
FORMS: dict[str, tuple[str, ...]] = {
    "tokens": TOKENS,
    "sharegpt": ("conversations", "messages", "chosen", "rejected", "system", "tools"),
    "alpaca": ("instruction", "input", "chosen", "rejected", "system", "history"),
    "trl": ("prompt", "chosen", "rejected", "tools"),
    "implicit": ("chosen", "rejected", "tools"),
}
SAME, EMPTY = "chosen equals rejected", "empty completion"  # why a pair is skipped


@dataclass
class Pair:
    prompt: np.ndarray  # (P,) int32
    chosen: np.ndarray  # (C,) int32, the completion only
    rejected: np.ndarray  # (R,) int32


def pair_form(columns: list[str]) -> str:
    """Which preference form a dataset's fields are (format `preference`)."""
    if "chosen_input_ids" in columns or "rejected_input_ids" in columns:
        return "tokens"
    if "conversations" in columns or "messages" in columns:
        return "sharegpt"
    for form in ("alpaca", "trl"):
        if FORMS[form][0] in columns:
            return form
    return "implicit"


def columns_of(form: str, columns: list[str]) -> list[str]:
    return [c for c in columns if c in FORMS[form]]


class PairEncoder:
    """Encodes a dataset's preference records (`name`) of one form into Pairs or skip reasons."""

    def __init__(self, form: str, tokenizer, name: str, vocab: Vocab | None, judge: Unread | None = None):
        if form != "tokens" and tokenizer is None:
            from .encode import NoTokenizer

            raise NoTokenizer("preference")
        self.form, self.tok, self.name, self.vocab = form, tokenizer, name, vocab
        self.judge = judge or Unread("preference", name)  # message fields no one reads (fields.py)
        self.chat = form != "tokens" and templates.chat_template_of(tokenizer) is not None
        self.notes: Counter = Counter()  # message fields no form reads, per record

    def encode(self, batch: dict[str, list], first: int) -> list[Pair | str]:
        n = len(next(iter(batch.values())))
        out: list[Pair | str] = []
        for i in range(n):
            rec, where = {k: v[i] for k, v in batch.items()}, f"{self.name}: record {first + i}"
            out.append(self._one(rec, where))
        return out

    def _one(self, rec: dict, where: str) -> Pair | str:
        for k in ("chosen", "rejected") if self.form != "tokens" else TOKENS[1:]:
            if rec.get(k) is None:
                raise InputError(
                    f"{where}: has no {k!r}; a preference record needs both completions (chosen and rejected)"
                )
        if self.form == "tokens":
            pair = Pair(*(self._ids(rec.get(k), k, where) for k in TOKENS))
            if not len(pair.chosen) or not len(pair.rejected):
                return EMPTY
        else:
            prompt, chosen, rejected, tools = self._texts(rec, where)
            if _blank(chosen) or _blank(rejected):
                return EMPTY
            pair = self._tokenize(prompt, chosen, rejected, tools)
        if np.array_equal(pair.chosen, pair.rejected):
            return SAME
        for ids in (pair.prompt, pair.chosen, pair.rejected):
            self._check(ids, where)
        return pair

    # -- records -> prompt and completions (strings, or message lists) -------------------------
    def _texts(self, rec: dict, where: str) -> tuple[Any, Any, Any, list | None]:
        """(prompt, chosen, rejected, tools): strings, or message lists."""
        form, tools = self.form, tools_of(rec.get("tools"), where)
        chosen: Any
        rejected: Any
        if form == "sharegpt":
            turns = {k: rec.get(k) for k in ("messages", "conversations", "system")}
            conv = chat_record(turns, where, self.notes, self.judge)
            prompt = conv.messages
            chosen, rejected = (
                [_reply(rec[k], k, where)] for k in ("chosen", "rejected")
            )  # one message each
        elif form == "alpaca":
            ins = instruction_record({**rec, "output": ""}, where)
            chosen, rejected = (text_of(rec[k], k, where) for k in ("chosen", "rejected"))
            if not self.chat:  # the Alpaca prompt, then the completions as plain text
                return templates.alpaca(ins).text, chosen, rejected, None
            prompt = ins.as_chat().messages[:-1]
            chosen, rejected = ([{"role": "assistant", "content": c}] for c in (chosen, rejected))
        else:
            chosen, rejected = (self._value(rec[k], k, where) for k in ("chosen", "rejected"))
            if form == "implicit":
                prompt, chosen, rejected = extract_prompt(chosen, rejected)
            else:
                prompt = self._value(rec.get("prompt"), "prompt", where)
            if isinstance(prompt, list) != isinstance(chosen, list) or isinstance(chosen, list) != isinstance(
                rejected, list
            ):
                raise InputError(
                    f"{where}: prompt, chosen and rejected must all be strings or all message lists"
                )
        if isinstance(chosen, list) and not self.chat:
            raise InputError(
                "tokenizer: conversational preference records need a chat template, and this tokenizer has none"
            )
        return prompt, chosen, rejected, tools

    # -- tokenization, as TRL's DPOTrainer -----------------------------------------------------
    def _tokenize(self, prompt, chosen, rejected, tools) -> Pair:
        if isinstance(chosen, list):
            p = self._render(prompt, tools, gen=True)
            pc, pr = self._render(prompt + chosen, tools), self._render(prompt + rejected, tools)
        else:
            eos = self.tok.eos_token
            if eos:
                chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
            p, pc, pr = (self.tok(text=t)["input_ids"] for t in (prompt, prompt + chosen, prompt + rejected))
        n = min(_common(p, pc), _common(p, pr))
        arr = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
        return Pair(arr(p[:n]), arr(pc[n:]), arr(pr[n:]))

    def _value(self, v, what: str, where: str):
        """A string, or a message list [{role, content}] read as chats are (records.turns_of: tool
        calls kept, the fields no one reads judged)."""
        if not isinstance(v, list):
            return text_of(v, what, where)
        msgs, weights = turns_of(v, what, where, self.notes, self.judge)
        if any(w is not None for w in weights):
            raise InputError(f"{where}: {what} has a message weight, which a preference pair has no use for")
        return msgs

    def _render(self, messages: list[dict], tools, gen: bool = False) -> list[int]:
        out = self.tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=gen, tools=tools
        )
        return list(out["input_ids"])

    def _ids(self, value, field: str, where: str) -> np.ndarray:
        ids = _int_array(value, field, where)
        self._check(ids, where, field)
        return ids

    def _check(self, ids: np.ndarray, where: str, field: str = "the tokenized pair") -> None:
        v = self.vocab
        if v is not None and len(ids) and (ids.min() < 0 or ids.max() >= v.size):
            bad = int(ids[(ids < 0) | (ids >= v.size)][0])
            raise InputError(f"{where}: {field} holds id {bad}, outside {v.what}")


def extract_prompt(chosen, rejected):
    """TRL's implicit prompt: the longest shared beginning of chosen and rejected (messages, or
    characters; a space before the first difference goes with the completions)."""
    n = 0
    for a, b in zip(chosen, rejected, strict=False):
        if a != b:
            break
        n += 1
    if isinstance(chosen, str) and n and chosen[n - 1] == " " and n < min(len(chosen), len(rejected)):
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _blank(v) -> bool:
    if isinstance(v, str):
        return not v.strip()
    return not v or all(not str(m.get("content") or "").strip() for m in v)


def _reply(m, what: str, where: str) -> dict:
    """LLaMA-Factory's sharegpt completion: one message ({from, value} or {role, content})."""
    if isinstance(m, list) and len(m) == 1:
        m = m[0]
    if not isinstance(m, dict):
        raise InputError(f"{where}: {what} must be one message ({{from, value}}), got {type(m).__name__}")
    role = m.get("from", m.get("role"))
    if SHAREGPT_ROLES.get(str(role), role) != "assistant":
        raise InputError(f"{where}: {what} must be an assistant message, got from={role!r}")
    return {"role": "assistant", "content": text_of(m.get("value", m.get("content")), what, where)}
