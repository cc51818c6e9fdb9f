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
    preference         {"chosen", "rejected"} with a "prompt", "conversations"/"messages" or
                       "instruction" (or an implicit prompt), or pre-tokenized {"prompt_input_ids",
                       "chosen_input_ids", "rejected_input_ids"}: pairs (data.preference, data.pairs),
                       trained by a `preference:` section
    unpaired           {"completion", "label": bool} (TRL, with a "prompt"), or LLaMA-Factory's
                       "kto_tag" (bool) on alpaca or sharegpt records: unpaired preference
                       (data.unpaired), trained by `preference: {loss: kto}`
    prompt             {"prompt"} (text or messages) or {"prompt_input_ids"} and nothing of the
                       above: TRL's prompt-only records (data.prompt_only), trained online by `rl:`

`auto` picks the first format whose fields are present, in the order tokens, preference, unpaired, chat,
prompt_completion, instruction, text (the most specific first: a pre-tokenized set may also carry
its `text`, a preference pair its `messages` or `instruction`).

The fields a format does not read are judged by `fields.py`: metadata, text (a warning), or
meaning (refused).
"""

from __future__ import annotations

from ..errors import InputError

FORMATS = ("text", "instruction", "chat", "prompt_completion", "tokens", "preference", "unpaired", "prompt")
# `auto`, in order
DETECT = ("tokens", "preference", "unpaired", "chat", "prompt_completion", "instruction", "text", "prompt")

# format -> groups of fields; each group needs one of its alternatives
REQUIRED: dict[str, tuple[tuple[str, ...], ...]] = {
    "tokens": (("input_ids",),),
    "preference": (("chosen", "chosen_input_ids"), ("rejected", "rejected_input_ids")),
    "unpaired": (("kto_tag", "label"), ("completion", "output", "conversations", "messages")),
    "chat": (("messages", "conversations"),),
    "prompt_completion": (("prompt",), ("completion",)),
    "instruction": (("instruction",), ("output",)),
    "text": (("text",),),
    "prompt": (("prompt", "prompt_input_ids"),),
}
OPTIONAL = {
    "tokens": ("labels", "attention_mask"),
    "instruction": ("input", "system", "history"),
    "chat": ("system", "tools"),
    "prompt_completion": ("tools",),
    "text": (),
    "prompt": (),
    "unpaired": ("prompt", "instruction", "input", "system", "history", "tools"),
    "preference": (
        "prompt",
        "prompt_input_ids",
        "messages",
        "conversations",
        "instruction",
        "input",
        "system",
        "history",
        "tools",
    ),  # fmt: skip
}


def resolve_format(fmt: str, columns: list[str], name: str) -> str:
    """Configured format (or `auto`) + the dataset's fields -> the format to use, checked."""
    half = [f for f in ("chosen", "rejected") if f in columns]
    if fmt in ("auto", "preference") and len(half) == 1:  # one completion of a pair
        other = "rejected" if half == ["chosen"] else "chosen"
        raise InputError(
            f"{name}: has field {half[0]!r} but no {other!r}: a preference pair needs both completions"
        )
    if fmt == "auto":
        found = next((cand for cand in DETECT if _has_fields(cand, columns)), None)
        if found is None:
            raise InputError(
                f"{name}: cannot detect the data format from fields [{', '.join(columns)}]; expected text, "
                "instruction+output, prompt+completion, messages or conversations, chosen+rejected, "
                "or input_ids (or set data.format)"
            )
        return found
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


def _has_fields(fmt: str, columns: list[str]) -> bool:
    if fmt == "unpaired":  # LLaMA-Factory's kto_tag on any record, TRL's label with a completion
        pairs = "chosen" in columns and "rejected" in columns  # unpaired as TRL's KTOTrainer does
        return "kto_tag" in columns or ("label" in columns and "completion" in columns) or pairs
    if fmt == "prompt":  # a prompt and no completion of any kind
        return is_prompt_only(columns)
    return all(any(f in columns for f in group) for group in REQUIRED[fmt])


def is_prompt_only(columns: list[str]) -> bool:
    """TRL's prompt-only records: a prompt (or its ids), none of another format's fields."""
    others = ("completion", "chosen", "rejected", "messages", "conversations", "text", "output", "input_ids")
    return any(f in columns for f in ("prompt", "prompt_input_ids")) and not any(f in columns for f in others)
