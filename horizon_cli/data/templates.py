"""Data stage 2b, rendering: a record -> (text, character spans that carry loss).

Chat records go through the tokenizer's chat template. Each assistant turn's span is found by
rendering prefixes: with P = render(messages[:i], add_generation_prompt=True) and
Q = render(messages[:i + 1]), the turn is Q[len(P):], i.e. the reply plus the template's
end-of-turn marker; trailing whitespace after the marker is left out. When a template breaks the
prefix property (some rewrite earlier turns), the reply is searched for in the full rendering and
the special token right after it, if any, is taken as its end-of-turn marker.

Instruction records without a chat template use the Alpaca prompt below.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError

ALPACA_PROMPT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)


@dataclass
class Rendered:
    """text: the string to tokenize; spans: [start, end) character ranges with loss (None: all)."""

    text: str
    spans: list[tuple[int, int]] | None


def chat_template_of(tokenizer) -> str | dict | None:
    return getattr(tokenizer, "chat_template", None) or None


def alpaca(record: dict) -> Rendered:
    """Alpaca prompt + output; loss on the output (the caller appends EOS)."""
    instruction, extra = record.get("instruction") or "", record.get("input") or ""
    template = ALPACA_PROMPT_INPUT if extra else ALPACA_PROMPT
    prompt = template.format(instruction=instruction, input=extra)
    text = prompt + (record.get("output") or "")
    return Rendered(text, [(len(prompt), len(text))])


def has_generation_prompt(tokenizer) -> bool:
    """Whether the template writes an assistant header for add_generation_prompt=True."""
    probe = [{"role": "user", "content": "x"}]
    try:
        return _render(tokenizer, probe, True, "") != _render(tokenizer, probe, False, "")
    except InputError:
        return True


def chat(tokenizer, messages: list[dict], where: str, gen_prompt: bool = True) -> Rendered:
    """Messages -> the template's rendering and the spans of its assistant turns.

    gen_prompt: `has_generation_prompt(tokenizer)`, computed once by the caller.
    """
    full = _render(tokenizer, messages, False, where)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        span = _span_by_prefix(tokenizer, messages, i, full, gen_prompt)
        span = span or _span_by_search(tokenizer, full, m, cursor)
        if span is None:
            raise InputError(f"{where}: cannot locate assistant message {i} in the chat template's output")
        spans.append(span)
        cursor = span[1]
    return Rendered(full, spans)


def _span_by_prefix(
    tokenizer, messages: list[dict], i: int, full: str, gen_prompt: bool
) -> tuple[int, int] | None:
    """Q[len(P):] when P (prompt) prefixes Q (prompt + reply) and Q prefixes the full text."""
    try:
        p = _render(tokenizer, messages[:i], True, "")
        q = _render(tokenizer, messages[: i + 1], False, "")
    except InputError:  # e.g. a template that refuses a conversation starting with the assistant
        return None
    if not (q.startswith(p) and full.startswith(q)):
        return None
    start = len(p)
    if not gen_prompt:  # P ends before the turn header: skip the header up to the reply itself
        found = q.find(messages[i]["content"].strip(), start)
        start = found if found >= 0 else start
    return start, max(start, len(q.rstrip()))


def _span_by_search(tokenizer, full: str, m: dict, cursor: int) -> tuple[int, int] | None:
    """The reply's first occurrence after `cursor`, extended over a special token right after it."""
    reply = m["content"].strip()
    start = full.find(reply, cursor)
    if start < 0:
        return None
    end = start + len(reply)
    for marker in _special_texts(tokenizer):
        if full.startswith(marker, end):
            return start, end + len(marker)
    return start, end


def _special_texts(tokenizer) -> list[str]:
    """Special added tokens, longest first (a marker may prefix another)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {t.content for t in decoder.values() if getattr(t, "special", False)}
    return sorted(texts, key=len, reverse=True)


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja raises its own errors, templates raise via raise_exception()
        raise InputError(f"{where}: the chat template failed on this conversation: {e}") from None
