"""Data stage 2a, formats: which fields a format reads, and `auto` detection.

    text               {"text": str}
    prompt_completion  {"prompt", "completion"} (TRL): both strings, or both message lists
                       [{"role", "content"}, ...]; optional "tools"
    instruction        {"instruction", "input" (optional), "output"}  (Alpaca), optional LLaMA-Factory
                       "system" and "history" [[prompt, response], ...]
    chat               {"messages": [{"role", "content", ...}, ...]}
                       or sharegpt {"conversations": [{"from", "value"}, ...]}; optional "system", "tools"
    tokens             {"input_ids": [int], "labels": [int] (optional, -100 = no loss)}, optional
                       "attention_mask" (all ones: horizon never pads inside a record)
    preference         {"chosen", "rejected"} with a "prompt", "messages"/"conversations" or
                       "instruction": recognised so that pairs are never read as something else,
                       and refused (preference training is not supported yet)

`auto` picks the first format whose fields are present, in the order tokens, preference, chat,
prompt_completion, instruction, text (the most specific first: a pre-tokenized set may also carry
its `text`, a preference pair its `messages` or `instruction`).

The fields a format does not read are judged by `fields.py`: metadata, text (a warning), or
meaning (refused).
"""

from __future__ import annotations

from ..errors import InputError

FORMATS = ("text", "instruction", "chat", "prompt_completion", "tokens", "preference")
DETECT = ("tokens", "preference", "chat", "prompt_completion", "instruction", "text")  # `auto`, in order

# format -> groups of fields; each group needs one of its alternatives
REQUIRED: dict[str, tuple[tuple[str, ...], ...]] = {
    "tokens": (("input_ids",),),
    "preference": (("chosen",), ("rejected",)),
    "chat": (("messages", "conversations"),),
    "prompt_completion": (("prompt",), ("completion",)),
    "instruction": (("instruction",), ("output",)),
    "text": (("text",),),
}
OPTIONAL = {
    "tokens": ("labels", "attention_mask"),
    "instruction": ("input", "system", "history"),
    "chat": ("system", "tools"),
    "prompt_completion": ("tools",),
    "text": (),
    "preference": ("prompt", "messages", "conversations", "instruction", "input", "system", "tools"),
}
# formats recognised but not trained yet: why, in one line
UNSUPPORTED = {
    "preference": "fields chosen and rejected hold preference pairs, and preference training "
    "(format preference) is not supported yet; horizon trains text, instruction, chat, "
    "prompt_completion and tokens data",
}


def resolve_format(fmt: str, columns: list[str], name: str) -> str:
    """Configured format (or `auto`) + the dataset's fields -> the format to use, checked."""
    if fmt == "auto":
        found = next((cand for cand in DETECT if _has_fields(cand, columns)), None)
        if found is None:
            raise InputError(
                f"{name}: cannot detect the data format from fields [{', '.join(columns)}]; expected text, "
                "instruction+output, prompt+completion, messages or conversations, or input_ids "
                "(or set data.format)"
            )
        return _supported(found, name)
    if fmt not in FORMATS:
        raise InputError(
            f"data.format: unknown format {fmt!r} (expected auto or one of {', '.join(FORMATS)})"
        )
    if not _has_fields(fmt, columns):
        need = " and ".join("/".join(group) for group in REQUIRED[fmt])
        raise InputError(
            f"{name}: format {fmt!r} needs field(s) {need}; the data has fields [{', '.join(columns)}]"
        )
    return _supported(fmt, name)


def _supported(fmt: str, name: str) -> str:
    if fmt in UNSUPPORTED:
        raise InputError(f"{name}: {UNSUPPORTED[fmt]}")
    return fmt


def columns_for(fmt: str, columns: list[str]) -> list[str]:
    """The dataset columns a format reads (only these are pulled out of arrow). A chat set with
    both `messages` and `conversations` reads `messages`."""
    groups = [tuple(f for f in group if f in columns)[:1] for group in REQUIRED[fmt]]
    wanted = {f for group in groups for f in group} | set(OPTIONAL[fmt])
    return [c for c in columns if c in wanted]


def _has_fields(fmt: str, columns: list[str]) -> bool:
    return all(any(f in columns for f in group) for group in REQUIRED[fmt])
