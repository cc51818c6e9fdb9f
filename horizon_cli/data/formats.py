"""Data stage 2a, formats: which fields a format reads, `auto` detection, record normalization.

    text         {"text": str}
    instruction  {"instruction": str, "input": str (optional), "output": str}      (alpaca)
    chat         {"messages": [{"role", "content"}, ...]}
                 or sharegpt {"conversations": [{"from", "value"}, ...]}
    tokens       {"input_ids": [int], "labels": [int] (optional, -100 = no loss)}

`auto` picks the first format whose fields are present, in the order tokens, chat, instruction,
text (the most specific first: a pre-tokenized set may also carry its `text`).
"""

from __future__ import annotations

from ..errors import InputError

FORMATS = ("text", "instruction", "chat", "tokens")

# format -> groups of fields; each group needs one of its alternatives
REQUIRED: dict[str, tuple[tuple[str, ...], ...]] = {
    "tokens": (("input_ids",),),
    "chat": (("messages", "conversations"),),
    "instruction": (("instruction",), ("output",)),
    "text": (("text",),),
}
OPTIONAL = {"tokens": ("labels",), "instruction": ("input",), "chat": (), "text": ()}

# sharegpt `from` -> chat role
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
}


def resolve_format(fmt: str, columns: list[str], name: str) -> str:
    """Configured format (or `auto`) + the dataset's fields -> the format to use, checked."""
    if fmt == "auto":
        for cand in ("tokens", "chat", "instruction", "text"):
            if _has_fields(cand, columns):
                return cand
        raise InputError(
            f"{name}: cannot detect the data format from fields [{', '.join(columns)}]; expected text, "
            "instruction+output, messages or conversations, or input_ids (or set data.format)"
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
    """The dataset columns a format reads (only these are pulled out of arrow)."""
    wanted = {f for group in REQUIRED[fmt] for f in group} | set(OPTIONAL[fmt])
    return [c for c in columns if c in wanted]


def chat_messages(record: dict, where: str) -> list[dict]:
    """A chat record -> [{"role", "content"}], mapping sharegpt turns; an empty list if it has none."""
    if record.get("messages") is not None:
        return [_message(m, "role", "content", where, i) for i, m in enumerate(record["messages"])]
    turns = record.get("conversations") or []
    out = []
    for i, t in enumerate(turns):
        m = _message(t, "from", "value", where, i)
        role = SHAREGPT_ROLES.get(m["role"])
        if role is None:
            raise InputError(
                f"{where}: conversations[{i}] has from={m['role']!r} "
                f"(expected one of {', '.join(SHAREGPT_ROLES)})"
            )
        out.append({"role": role, "content": m["content"]})
    return out


def instruction_prompt(record: dict) -> tuple[str, str]:
    """An alpaca record -> (user prompt: instruction, blank line, input if any; response)."""
    instruction = record.get("instruction") or ""
    extra = record.get("input") or ""
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    return prompt, record.get("output") or ""


def _has_fields(fmt: str, columns: list[str]) -> bool:
    return all(any(f in columns for f in group) for group in REQUIRED[fmt])


def _message(m: object, role_key: str, content_key: str, where: str, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get(role_key), str):
        raise InputError(f"{where}: message {i} must be an object with a string {role_key!r}")
    content = m.get(content_key)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise InputError(
            f"{where}: message {i} {content_key!r} must be a string, got {type(content).__name__}"
        )
    return {"role": m[role_key], "content": content}
