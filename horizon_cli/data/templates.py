"""Data stage 2c, rendering: a record -> (text, character spans that carry loss).

Chat records go through the tokenizer's chat template. Each assistant turn's span is found by
rendering prefixes: with P = render(messages[:i], add_generation_prompt=True) and
Q = render(messages[:i + 1]), the turn is Q[len(P):] whole: the reply, the template's end-of-turn
marker and what the template writes after it (ChatML's `<|im_end|>\n`), as TRL's training
templates put inside {% generation %} and LLaMA-Factory's qwen/chatml `format_assistant` slot
(`{{content}}<|im_end|>\n`) label it; the vision path (vision.encode) labels the same tokens. When a
template breaks the prefix property (some rewrite earlier turns), the reply is searched for in the
full rendering and the special token right after it, if any, is taken as its end-of-turn marker,
with the whitespace the template writes after that marker.

Every rendering is checked against the record (`check_rendered`): a template that drops a
message's content, the tool calls or the tool schemas stops the run with a line naming the record
and the field, instead of training on text the user did not write.

Instruction records without a chat template use the Alpaca prompt below.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .records import Chat, Instruction

ALPACA_HEAD = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request."
)
ALPACA_HEAD_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
)


@dataclass
class Rendered:
    """text: the string to tokenize; spans: [start, end) character ranges with loss (None: all)."""

    text: str
    spans: list[tuple[int, int]] | None


def configure(tokenizer, data_cfg):
    """The tokenizer with the `data:` section's chat template and template kwargs: every
    apply_chat_template of the run (SFT, preference, KTO and GRPO prompts) renders with them, as
    TRL's chat_template_path and chat_template_kwargs do. None stays None."""
    if tokenizer is None:
        return None
    given = data_cfg.chat_template
    if given is not None:
        path = Path(given).expanduser()
        is_file = given.endswith((".jinja", ".j2")) and "{" not in given
        if is_file and not path.is_file():
            raise InputError(
                f"data.chat_template: {given} does not exist (a .jinja file, or the template itself)"
            )
        tokenizer.chat_template = path.read_text(encoding="utf-8") if is_file else given
    kwargs = dict(data_cfg.chat_template_kwargs or {})
    if kwargs:
        tokenizer.apply_chat_template = functools.partial(tokenizer.apply_chat_template, **kwargs)
    return tokenizer


def chat_template_of(tokenizer) -> str | dict | None:
    return getattr(tokenizer, "chat_template", None) or None


def alpaca(ins: Instruction) -> Rendered:
    """Alpaca prompt + output; loss on the output (the caller appends EOS) and on the responses of
    `history`, which come first as earlier Instruction/Response blocks. `system` replaces the
    Alpaca preamble."""
    text = (ins.system or (ALPACA_HEAD_INPUT if ins.input else ALPACA_HEAD)) + "\n\n"
    spans = []
    for prompt, response in ins.history:
        text += f"### Instruction:\n{prompt}\n\n### Response:\n"
        spans.append((len(text), len(text) + len(response)))
        text += response + "\n\n"
    text += f"### Instruction:\n{ins.instruction}\n\n"
    if ins.input:
        text += f"### Input:\n{ins.input}\n\n"
    text += "### Response:\n"
    spans.append((len(text), len(text) + len(ins.output)))
    return Rendered(text + ins.output, spans)


def has_generation_prompt(tokenizer) -> bool:
    """Whether the template writes an assistant header for add_generation_prompt=True."""
    probe = [{"role": "user", "content": "x"}]
    try:
        return render(tokenizer, probe, True, "") != render(tokenizer, probe, False, "")
    except InputError:
        return True


def chat(tokenizer, conv: Chat, where: str, gen_prompt: bool = True) -> Rendered:
    """A conversation -> the template's rendering and the spans of its trained assistant turns.

    gen_prompt: `has_generation_prompt(tokenizer)`, computed once by the caller. Stops with an
    InputError when the rendering lost something the record holds (see `check_rendered`).
    """
    messages, tools = conv.messages, conv.tools
    full = render(tokenizer, messages, False, where, tools)
    check_rendered(tokenizer, conv, full, where)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i in conv.no_loss:
            continue
        span = _span_by_prefix(tokenizer, messages, i, full, gen_prompt, tools)
        span = span or _span_by_search(tokenizer, full, m, cursor)
        if span is None:
            raise InputError(f"{where}: cannot locate assistant message {i} in the chat template's output")
        spans.append(span)
        cursor = span[1]
    return Rendered(full, spans)


def check_rendered(tokenizer, conv: Chat, full: str, where: str) -> None:
    """Everything the conversation holds must reach the text, or training would silently lose it.

    Checked by rendering: each message's content (trimmed; templates may trim) appears in the
    text, in order where it can (a template may move the system prompt); each tool call's
    function name appears, and the text changes when the tool calls are left out; with `tools`,
    each tool's name appears and the text changes when they are left out.
    """
    cursor = 0
    for i, m in enumerate(conv.messages):
        content = m["content"].strip()
        if not content:
            continue
        at = full.find(content, cursor)
        if at < 0 and full.find(content) < 0:
            raise InputError(
                f"{where}: message {i} ({m['role']}): the chat template does not render its content"
            )
        cursor = at + len(content) if at >= 0 else cursor
    calls = [(i, c) for i, m in enumerate(conv.messages) for c in m.get("tool_calls", ())]
    if calls:
        plain = [{k: v for k, v in m.items() if k != "tool_calls"} for m in conv.messages]
        names = [c["function"]["name"] for _, c in calls]
        _check_part(tokenizer, full, plain, conv.tools, names, f"{where}: message {calls[0][0]} tool_calls")
    if conv.tools:
        fns = [t["function"] if isinstance(t.get("function"), dict) else t for t in conv.tools]
        names = [fn.get("name") for fn in fns]
        _check_part(tokenizer, full, conv.messages, None, names, f"{where}: tools")


def _check_part(tokenizer, full: str, without: list[dict], tools, names: list, what: str) -> None:
    """`what` is rendered when the text changes without it and each of its names appears."""
    missing = [n for n in names if isinstance(n, str) and n not in full]
    try:
        same = render(tokenizer, without, False, "", tools) == full
    except InputError:  # the template needs the part to render at all: it uses it
        same = False
    if same or missing:
        detail = f" (missing: {', '.join(missing)})" if missing else ""
        raise InputError(f"{what}: the chat template does not render them{detail}")


def _span_by_prefix(
    tokenizer, messages: list[dict], i: int, full: str, gen_prompt: bool, tools=None
) -> tuple[int, int] | None:
    """Q[len(P):] when P (prompt) prefixes Q (prompt + reply) and Q prefixes the full text."""
    try:
        p = render(tokenizer, messages[:i], True, "", tools)
        q = render(tokenizer, messages[: i + 1], False, "", tools)
    except InputError:  # e.g. a template that refuses a conversation starting with the assistant
        return None
    if not (q.startswith(p) and full.startswith(q)):
        return None
    start = len(p)
    if not gen_prompt:  # P ends before the turn header: skip the header up to the reply itself
        found = q.find(messages[i]["content"].strip(), start)
        start = found if found >= 0 else start
    return start, len(q)  # the whole turn, the whitespace after its marker too (TRL, LLaMA-Factory)


def _span_by_search(tokenizer, full: str, m: dict, cursor: int) -> tuple[int, int] | None:
    """The reply's first occurrence after `cursor`, extended over a special token right after it."""
    reply = m["content"].strip()
    start = full.find(reply, cursor)
    if start < 0 or not reply:  # an empty reply (a tool call) cannot be searched for
        return None
    end = start + len(reply)
    for marker in _special_texts(tokenizer):
        if full.startswith(marker, end):
            end += len(marker)
            while end < len(full) and full[end].isspace():  # what follows the marker, as the prefix rule
                end += 1
            return start, end
    return start, end


def _special_texts(tokenizer) -> list[str]:
    """Special added tokens, longest first (a marker may prefix another)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {t.content for t in decoder.values() if getattr(t, "special", False)}
    return sorted(texts, key=len, reverse=True)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, where: str, tools=None) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja raises its own errors, templates raise via raise_exception()
        raise InputError(f"{where}: the chat template failed on this conversation: {e}") from None
