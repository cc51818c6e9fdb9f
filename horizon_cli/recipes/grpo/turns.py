"""A step's multi-turn rollouts: TRL 1.16's GRPOTrainer `_tool_call_loop`, run inside the decode
loop (generate.decoder's `more` hook) instead of around it.

When a row finishes a turn (an EOS id, or its token limit), the turn's ids are parsed with the
tokenizer's response template (transformers' parse_response, the prompt and the turns before it
as the prefix; a malformed turn is plain text, as TRL's parse_response falls back) and appended
to the row's completion messages. Its tool calls, if any and the row has made fewer than
rl.max_tool_calling_iterations rounds, are executed in order (each in a thread, failing after
rl.tool_timeout_s): the synchronous ones first, then the `async def` ones, as TRL collects them.
A call that raises, names an unknown tool, has arguments its function does not take, or times
out fails: its result is {"error": "..."} and it counts in tools/failure_frequency. The results
go to the model as tool messages, tokenized as TRL does (the chat template's ids after the
conversation's last EOS, the generation prompt included: `suffix_ids`), and the row goes on with
its KV cache from where it stopped. Results that would take the completion past
rl.max_completion_length (or the model's positions) are rolled back, and the row ends there.

Per completion id the tool mask is 1 for what the model sampled and 0 for a tool result: those
ids get no label, so no loss and no KL (recipes.grpo.rollouts), as TRL's tool_mask.

A tool returning a value whose str() raises, or a list (TRL's multimodal content, not supported
here), stops the run with one line naming the tool and the completion.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...errors import InputError
from ...generate.decoder import Completion
from .tools import Toolbox


@dataclass
class Turns:
    """One rollout's turns."""

    prompt: list[int]
    tools: list[Callable]
    where: str  # "completion j of <record>", for messages
    env: object | None = None
    messages: list[dict] = field(default_factory=list)  # the completion's: assistant and tool turns
    spans: list[tuple[int, int]] = field(default_factory=list)  # tool results' [a, b) in the ids
    start: int = 0  # where the turn being sampled begins in the completion ids
    rounds: int = 0
    calls: int = 0
    failures: int = 0

    def mask(self, n: int) -> list[int]:
        """Per completion id: 1 sampled, 0 a tool result's."""
        out = [1] * n
        for a, b in self.spans:
            out[a:b] = [0] * (b - a)
        return out


class ToolRollouts:
    def __init__(self, box: Toolbox, tokenizer: Any, max_len: int, positions: int):
        self.box, self.tok = box, tokenizer
        self.max_len, self.positions = max_len, positions
        self.rows: dict[int, Turns] = {}
        self.failed: str | None = None  # the step's first failing call, for its warning line

    def add(self, row: int, prompt: list[int], where: str, record: dict) -> None:
        """A rollout of the prompt `record` ({"prompt": ..., columns}): its environment made and reset."""
        env = None
        if self.box.environment is not None:
            env = self.box.make(where)
            try:
                seen = env.reset(**record)
            except Exception as e:
                raise InputError(
                    f"rl.environment ({self.box.env_name}): reset raised {type(e).__name__}: {e} ({where})"
                ) from None
            if seen is not None:
                raise InputError(
                    f"rl.environment ({self.box.env_name}): reset returned an observation ({where}); an "
                    "observation appended to the prompt is not supported yet (return None)"
                )
        self.rows[row] = Turns(list(prompt), self.box.tools(env), where, env)

    # -- the decoder's hook --------------------------------------------------------------------
    def more(self, c: Completion) -> list[int]:
        """At a row's finish: its turn parsed; its tool calls run; the ids to append (none: it ends)."""
        t = self.rows[c.index]
        seg = c.ids[t.start :]
        msg = parse(self.tok, seg, t.prompt + c.ids[: t.start], t.tools) if seg else {}
        if msg:
            t.messages.append(msg)
        calls = msg.get("tool_calls")
        if not calls or t.rounds >= self.box.max_rounds:
            return []
        before = len(t.messages)
        t.messages += [{"role": "tool", "name": n, "content": v} for n, v in self._run(t, calls)]
        suffix = suffix_ids(self.tok, t.messages[before:])
        n = len(c.ids) + len(suffix)
        if n > self.max_len or len(t.prompt) + n >= self.positions:  # rolled back, as TRL does
            del t.messages[before:]
            return []
        t.spans.append((len(c.ids), n))
        t.start, t.rounds = n, t.rounds + 1
        return suffix

    # -- the calls -----------------------------------------------------------------------------
    def _run(self, t: Turns, calls: list[dict]) -> list[tuple[str, str]]:
        """The calls' (name, content): the synchronous tools' results, then the async ones' (an
        async call whose arguments do not bind fails at once, with the synchronous ones: TRL's order)."""
        table = {f.__name__: f for f in t.tools}
        first: list[tuple[str, object]] = []
        later: list[tuple[str, object]] = []
        for call in calls:
            t.calls += 1
            if call.get("type", "function") != "function":
                name, why = call.get("name", "unknown"), f"Unsupported tool call type: {call.get('type')}"
                self._fail(t, name, why)
                first.append((name, {"error": why}))
                continue
            name, args = call["function"]["name"], call["function"].get("arguments")
            tool = table.get(name)
            try:  # an unknown tool, or an async one whose arguments do not bind: fails at once
                if tool is None:
                    raise ValueError(f"Tool {name} not found.")
                coro = tool(**args) if inspect.iscoroutinefunction(tool) else None
            except Exception as e:
                self._fail(t, name, f"{type(e).__name__}: {e}")
                first.append((name, {"error": str(e)}))
                continue
            try:
                got = self._call(coro if coro is not None else lambda tool=tool, args=args: tool(**args))
            except Exception as e:  # the tool's own error goes back to the model, as TRL does
                self._fail(t, name, f"{type(e).__name__}: {e}")
                got = {"error": str(e)}
            (later if coro is not None else first).append((name, got))
        return [(n, self._content(t, n, v)) for n, v in first + later]

    def _call(self, run: Any) -> object:  # a function of no arguments, or a coroutine
        """A call's result (its exception raised): a function called, or a coroutine awaited, in a
        thread of its own, failing after rl.tool_timeout_s."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["ok"] = asyncio.run(run) if inspect.iscoroutine(run) else run()
            except BaseException as e:
                box["err"] = e

        th = threading.Thread(target=target, daemon=True, name="horizon tool call")
        th.start()
        th.join(self.box.timeout_s)
        if th.is_alive():  # left running (a thread cannot be stopped): its result is dropped
            raise TimeoutError(f"timed out after {self.box.timeout_s:g} s")
        if "err" in box:
            raise box["err"]
        return box.get("ok")

    def _fail(self, t: Turns, name: str, why: str) -> None:
        t.failures += 1
        if self.failed is None:
            self.failed = f"tool {name} failed on {t.where}: {why}"

    def _content(self, t: Turns, name: str, value: object) -> str:
        """A result as a tool message's content: str(value), as TRL renders it."""
        if isinstance(value, list):
            raise InputError(
                f"rl.tools ({name}): returned a list on {t.where}; multimodal tool results (content blocks) "
                "are not supported (return a string)"
            )
        try:
            return str(value)
        except Exception as e:
            raise InputError(
                f"rl.tools ({name}): returned a {type(value).__name__} that cannot be turned into text "
                f"({type(e).__name__}: {e}) on {t.where}"
            ) from None


def parse(tokenizer: Any, ids: list[int], prefix: list[int], tools: list[Callable]) -> dict:
    """One turn as a message (TRL 1.16's parse_response): the response template's parse, plain
    text when the turn is malformed."""
    try:
        if getattr(tokenizer, "response_template", None) is not None:
            got = tokenizer.parse_response(ids, prefix=prefix, tools=tools)
        else:
            got = tokenizer.parse_response(ids)
        if got is None:
            raise ValueError("parse_response returned None")
        if isinstance(got.get("content"), str):
            got["content"] = got["content"].removesuffix(tokenizer.eos_token)
        if not got.get("content"):
            got["content"] = ""
        if "tool_calls" in got:
            _valid_calls(got["tool_calls"])
    except (ValueError, TypeError):
        got = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return got


def _valid_calls(calls: object) -> None:
    """TRL's _validate_tool_calls: a list of dicts, each a name (nested under function or flat)."""
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    for c in calls:
        if not isinstance(c, dict):
            raise ValueError("a tool call must be a dict")
        fn = c.get("function") if "function" in c else c
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError("a tool call needs a name")
        if fn.get("arguments") is None:
            fn["arguments"] = {}


def suffix_ids(tokenizer: Any, tool_messages: list[dict]) -> list[int]:
    """The ids a turn's tool messages add after its last id (TRL's _get_tool_suffix_ids): the chat
    template on a dummy tool-calling conversation with and without them, cut after its last EOS."""
    call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
    kw = {"tokenize": True, "return_dict": False}
    head = list(tokenizer.apply_chat_template(dummy, add_generation_prompt=False, **kw))
    full = list(tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, **kw))
    eos = [i for i, t in enumerate(head) if t == tokenizer.eos_token_id]
    if eos:
        head = head[: eos[-1] + 1]
    if full[: len(head)] != head:
        raise InputError(
            "rl.tools: the chat template does not render a tool result as a suffix of the conversation before "
            "it (not prefix-preserving); use a training template that is"
        )
    return full[len(head) :]


def start(
    box: Toolbox, tokenizer: Any, prompts: list, G: int, first: int, max_len: int, positions: int
) -> ToolRollouts:
    """A step's session for the rows of `prompts` (data.prompt_only.PromptRow; prompt p's
    generation j is row (first + p) x G + j, as recipes.grpo.rollouts numbers them)."""
    s = ToolRollouts(box, tokenizer, max_len, positions)
    for p, row in enumerate(prompts):
        for j in range(G):
            s.add(
                (first + p) * G + j,
                row.ids,
                f"completion {j + 1} of {row.where}",
                {"prompt": row.prompt, **row.columns},
            )
    return s


def finish(s: ToolRollouts, outs: list, G: int, first: int) -> list[object | None]:
    """Each rollout (in row order) given its messages, tool mask and counts; -> their environments."""
    envs = []
    for k, o in enumerate(outs):
        t = s.rows[first * G + k]
        o.messages, o.mask, o.calls, o.failures = t.messages, t.mask(len(o.ids)), t.calls, t.failures
        envs.append(t.env)
    return envs


def tool_metrics(outs: list) -> dict[str, float]:
    """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed calls
    per call, 0 without calls)."""
    calls, failed = sum(o.calls for o in outs), sum(o.failures for o in outs)
    return {
        "tools/call_frequency": calls / max(len(outs), 1),
        "tools/failure_frequency": failed / calls if calls else 0.0,
    }
