"""Data stage 2b, records: one raw record -> the turns it holds, as text, checked.

Nothing a user wrote is dropped without a word: every text field goes through `text_of`
(scalars become their text, a list or object where text is meant is an error), every field
this module reads is listed below, and `notes` counts the fields it ignores so the caller can
name them, and a message field that may change what the turn means (a number, a boolean, or a
name like `train` or `label`) stops the run (see `fields.py`, which judges whole columns too).

    instruction  Alpaca, with LLaMA-Factory's `system` and `history` ([[prompt, response], ...])
                 -> Instruction(system, history, instruction, input, output)
    chat         OpenAI `messages` [{role, content, tool_calls, tool_call_id, name, weight}] or
                 ShareGPT `conversations` [{from, value, weight}] (from: human, gpt, system, tool,
                 observation, function_call), with an optional top-level `system` and `tools`;
                 turns are read by their keys (role/content or from/value) under either name
                 -> Chat(messages, tools, no_loss)
"""

from __future__ import annotations

import json
import numbers
from collections import Counter
from dataclasses import dataclass, field

from ..errors import InputError
from .fields import Unread

# sharegpt `from` -> chat role; function_call turns become assistant tool calls
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_call": "assistant",
}
# message fields read here, per shape; others are counted in `notes` when they carry content
OPENAI_FIELDS = {"role", "content", "tool_calls", "tool_call_id", "name", "weight"}
SHAREGPT_FIELDS = {"from", "value", "weight"}


@dataclass
class Instruction:
    instruction: str
    input: str
    output: str
    system: str = ""
    history: list[tuple[str, str]] = field(default_factory=list)  # earlier (prompt, response) turns

    def prompt(self) -> str:
        """The last user turn as LLaMA-Factory's alpaca converter writes it: the instruction and
        the input, each only when non-empty, joined by one newline."""
        return "\n".join(part for part in (self.instruction, self.input) if part)

    def as_chat(self) -> Chat:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for prompt, response in self.history:
            msgs += [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        msgs += [{"role": "user", "content": self.prompt()}, {"role": "assistant", "content": self.output}]
        return Chat(msgs)


@dataclass
class Chat:
    messages: list[dict]  # role, content (str); tool_calls, tool_call_id, name when given
    tools: list | None = None  # function schemas for the template's `tools`
    no_loss: frozenset[int] = frozenset()  # assistant messages with weight 0: shown, not trained

    @property
    def has_assistant(self) -> bool:
        return any(m["role"] == "assistant" for m in self.messages)


def text_of(value: object, what: str, where: str) -> str:
    """A text field's value as text: numbers and booleans as written in JSON ("4", "0", "true"),
    null as "". A float with a whole value prints without ".0" ("4"): JSON readers turn every
    number of a column into a float once one has a fraction, so 4 may arrive as 4.0."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        f = float(value)
        return str(int(f)) if f.is_integer() and abs(f) < 2**53 else repr(f)
    raise InputError(f"{where}: {what} must be text, got {_kind(value)}")


def instruction_record(record: dict, where: str) -> Instruction:
    history = record.get("history") or []
    if not isinstance(history, list):
        raise InputError(f"{where}: history must be a list of [prompt, response] pairs, got {_kind(history)}")
    pairs = []
    for i, pair in enumerate(history):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise InputError(f"{where}: history[{i}] must be a [prompt, response] pair, got {_kind(pair)}")
        pairs.append(
            (text_of(pair[0], f"history[{i}][0]", where), text_of(pair[1], f"history[{i}][1]", where))
        )
    return Instruction(
        instruction=text_of(record.get("instruction"), "instruction", where),
        input=text_of(record.get("input"), "input", where),
        output=text_of(record.get("output"), "output", where),
        system=text_of(record.get("system"), "system", where),
        history=pairs,
    )


def chat_record(record: dict, where: str, notes: Counter, judge: Unread | None = None) -> Chat:
    """A chat record -> Chat; an empty message list if it has none. `judge` decides what the
    message fields no one reads are (fields.Unread)."""
    name = "messages" if record.get("messages") is not None else "conversations"
    msgs, weights = turns_of(record.get(name) or [], name, where, notes, judge)
    system = text_of(record.get("system"), "system", where)
    if system:
        if msgs and msgs[0]["role"] == "system":
            if msgs[0]["content"] != system:  # which one the user meant is not ours to guess
                raise InputError(f"{where}: has both a `system` field and a different system message")
        else:
            msgs.insert(0, {"role": "system", "content": system})
            weights.insert(0, None)
    no_loss = frozenset(i for i, w in enumerate(weights) if w == 0)
    return Chat(msgs, tools_of(record.get("tools"), where), no_loss)


def turns_of(
    turns: object, name: str, where: str, notes: Counter, judge: Unread | None = None
) -> tuple[list[dict], list]:
    """A list of OpenAI or ShareGPT turns (field `name`) -> (messages, per-message weights); the
    message fields read by no one are counted in `notes` once per record."""
    unread: set[str] = set()
    judge = judge or Unread("chat", "")
    if isinstance(turns, list) and _is_sharegpt(turns):
        out = _sharegpt(turns, name, where, unread, judge)
    else:
        out = _openai(turns, name, where, unread, judge)
    notes.update(unread)
    return out


def _is_sharegpt(turns: object) -> bool:
    """Turns keyed from/value, whichever field holds them (datasets mix the two names)."""
    return isinstance(turns, list) and bool(turns) and isinstance(turns[0], dict) and "from" in turns[0]


def _openai(
    messages: object, name: str, where: str, unread: set[str], judge: Unread
) -> tuple[list[dict], list]:
    if not isinstance(messages, list):
        raise InputError(f"{where}: {name} must be a list, got {_kind(messages)}")
    out, weights = [], []
    for i, m in enumerate(messages):
        msg = _message(m, "role", "content", where, i)
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"message {i} tool_calls", where)
        for key in ("tool_call_id", "name"):
            if m.get(key) not in (None, ""):
                msg[key] = text_of(m[key], f"message {i} {key!r}", where)
        unread |= _unread(m, OPENAI_FIELDS, name, f"{where}: message {i}", judge)
        out.append(msg)
        weights.append(_weight(m, i, where))
    return out, weights


def _sharegpt(turns: list, name: str, where: str, unread: set[str], judge: Unread) -> tuple[list[dict], list]:
    out, weights = [], []
    for i, t in enumerate(turns):
        m = _message(t, "from", "value", where, i)
        role = SHAREGPT_ROLES.get(m["role"])
        if role is None:
            raise InputError(
                f"{where}: {name}[{i}] has from={m['role']!r} (expected one of {', '.join(SHAREGPT_ROLES)})"
            )
        msg = {"role": role, "content": m["content"]}
        if m["role"] == "function_call":  # LLaMA-Factory: the value is the call as JSON
            msg = {
                "role": role,
                "content": "",
                "tool_calls": _function_call(m["content"], f"{name}[{i}]", where),
            }
        unread |= _unread(t, SHAREGPT_FIELDS, name, f"{where}: message {i}", judge)
        out.append(msg)
        weights.append(_weight(t, i, where))
    return out, weights


def _message(m: object, role_key: str, content_key: str, where: str, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get(role_key), str):
        raise InputError(f"{where}: message {i} must be an object with a string {role_key!r}")
    content = text_of(m.get(content_key), f"message {i} {content_key!r}", where)
    return {"role": m[role_key], "content": content}


def _weight(m: dict, i: int, where: str) -> int | None:
    """OpenAI's per-message `weight`: 0 = no loss on this assistant turn, 1 = loss."""
    w = m.get("weight")
    if w is None:
        return None
    if w not in (0, 1) or isinstance(w, bool):
        raise InputError(f"{where}: message {i} weight must be 0 or 1, got {w!r}")
    return int(w)


def _tool_calls(calls: object, what: str, where: str) -> list[dict]:
    """OpenAI tool calls -> [{type, id?, function: {name, arguments}}]; arguments given as a JSON
    string become a mapping (what chat templates expect; most render it with `tojson`)."""
    if not isinstance(calls, list):
        raise InputError(f"{where}: {what} must be a list, got {_kind(calls)}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InputError(f"{where}: {what}[{j}] must be an object with a function name")
        args = _prune(fn.get("arguments"))
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
                args = parsed if isinstance(parsed, dict) else args
            except ValueError:
                pass
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call, dict) and call.get("id"):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _function_call(value: str, what: str, where: str) -> list[dict]:
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    calls = parsed if isinstance(parsed, list) else [parsed]
    if not all(isinstance(c, dict) for c in calls):
        raise InputError(f"{where}: {what} (function_call) must hold a JSON object with name and arguments")
    return _tool_calls(calls, what, where)


def tools_of(tools: object, where: str) -> list | None:
    """The record's tool schemas: a list, or a JSON string of one (LLaMA-Factory)."""
    if tools in (None, "", []):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise InputError(f"{where}: tools is a string that is not JSON") from None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InputError(f"{where}: tools must be a list of function schemas, got {_kind(tools)}")
    return _prune(tools)


def _prune(value):
    """Drop null-valued keys at any depth: Arrow gives every record's objects the union of all
    keys seen in the column, filling the missing ones with null."""
    if isinstance(value, dict):
        return {k: _prune(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_prune(v) for v in value]
    return value


def _unread(m: dict, known: set[str], list_field: str, where: str, judge: Unread) -> set[str]:
    """The fields of message m read by no one that carry text (an InputError for meaning)."""
    out = set()
    for k, v in m.items():
        shown = f"{list_field}[].{k}"
        if k not in known and judge.check(k, v, where, shown):
            out.add(shown)
    return out


def _kind(v: object) -> str:
    if isinstance(v, list | tuple):
        return "a list"
    return "an object" if isinstance(v, dict) else type(v).__name__
