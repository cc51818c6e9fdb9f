"""Tools in an `rl:` run's rollouts, as TRL 1.16's GRPOTrainer takes `tools` and
`environment_factory`: what is loaded and checked before any weight loads, and the prompts
rendered with the tools (recipes.grpo.turns runs the calls during a rollout).

    rl.tools         functions, "path/to/file.py:name" or "package.module:name" (as rewards are
                     named); each one's name, type hints and docstring are its schema
                     (transformers' get_json_schema), which the chat template renders (tools=)
    rl.environment   a class named alike: one instance per rollout (made with no arguments, then
                     reset(**record) with the prompt's record, its `prompt` included), its public
                     methods (but reset and get_reward) the rollout's tools besides rl.tools; the
                     reward functions get the instances as `environments` (one per completion)

Refused in one line before the run starts: a tool that is not callable or has no schema, an
environment that is not a class, has no reset or whose constructor raises, prompts that are not
conversations, a tokenizer without a chat template that renders tool calls and results or
without a response template (its tool calls could not be parsed).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ...config.schema import RLConfig
from ...errors import InputError
from .rewards import _import

if TYPE_CHECKING:
    from ...data.prompt_only import PromptSet

SKIPPED = ("reset", "get_reward")  # an environment's methods that are not tools (TRL's)


@dataclass
class Toolbox:
    functions: list[Callable]  # rl.tools
    environment: type | None  # rl.environment
    env_name: str
    max_rounds: int  # tool-calling rounds per completion at most
    timeout_s: float

    def tools(self, env: object | None = None) -> list[Callable]:
        """The tools of one rollout: rl.tools and its environment instance's methods."""
        return self.functions + (methods(env) if env is not None else [])

    def make(self, where: str) -> Any:  # the user's class: its methods are called by name
        """A fresh environment instance (a constructor that raises: one line naming `where`)."""
        assert self.environment is not None
        try:
            return self.environment()
        except Exception as e:
            raise InputError(
                f"rl.environment ({self.env_name}): its constructor raised {type(e).__name__}: {e} ({where})"
            ) from None


def methods(env: object) -> list[Callable]:
    """An environment instance's tools: its public methods but reset and get_reward (TRL's)."""
    return [
        getattr(env, n)
        for n, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
        if n not in SKIPPED and not n.startswith("_")
    ]


def load_toolbox(rl: RLConfig) -> Toolbox | None:
    """rl.tools and rl.environment imported and checked; None: the run uses no tools."""
    if not rl.tools and rl.environment is None:
        return None
    fns = []
    for i, spec in enumerate(rl.tools):
        key = f"rl.tools[{i}]"
        if ":" not in spec:
            raise InputError(f"{key}: {spec!r} names no function (path/to/file.py:name or module:name)")
        fns.append(_checked(_import(spec, key, ""), key))
    env: type | None = None
    name = ""
    if rl.environment is not None:
        if ":" not in rl.environment:
            raise InputError(
                f"rl.environment: {rl.environment!r} names no class (file.py:Name or module:Name)"
            )
        got = _import(rl.environment, "rl.environment", "")
        name = rl.environment.rpartition(":")[2]
        if not isinstance(got, type):
            raise InputError(f"rl.environment: {rl.environment} is not a class (one instance per rollout)")
        env = got
        if not callable(getattr(env, "reset", None)):
            raise InputError(
                f"rl.environment ({name}): it has no reset method (TRL's environments define one)"
            )
    rounds = rl.max_tool_calling_iterations
    box = Toolbox(fns, env, name, rounds if rounds is not None else 1 << 30, rl.tool_timeout_s)
    probe = box.make("made once to read its tools") if env is not None else None
    for m in methods(probe) if probe is not None else []:
        _checked(m, f"rl.environment ({name}).{m.__name__}")
    names = [f.__name__ for f in box.tools(probe)]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise InputError(f"rl.tools: two tools are named {twice!r} (a tool call names one)")
    if not names:
        raise InputError(f"rl.environment ({name}): it has no public method (no tool)")
    return box


def _checked(fn: object, key: str) -> Callable:
    """A tool: callable, with the schema the chat template renders (type hints, docstring)."""
    from transformers.utils import get_json_schema

    if not callable(fn):
        raise InputError(f"{key}: {fn!r} is not callable (a tool is a function)")
    try:
        get_json_schema(fn)
    except Exception as e:
        raise InputError(
            f"{key} ({getattr(fn, '__name__', fn)}): no tool schema: {e} (type hints and a Google-style docstring "
            "with Args:)"
        ) from None
    return fn


def check_tokenizer(tokenizer: Any) -> None:
    """The tokenizer renders tool calls and results and parses its responses (TRL's checks)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InputError("rl.tools: the tools are rendered by a chat template, and the tokenizer has none")
    has = getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None)
    if not has:
        raise InputError(
            "rl.tools: the tokenizer has no response template (tokenizer_config.json response_template), so "
            "the model's tool calls cannot be parsed (transformers' parse_response); set one (TRL's "
            "add_response_schema writes it for known templates)"
        )
    if not _renders_tool_turns(tokenizer):
        raise InputError(
            "rl.tools: the chat template does not render a tool call and its result (TRL's supports_tool_calling)"
        )


def _renders_tool_turns(tokenizer: Any) -> bool:
    calls = [{"type": "function", "function": {"name": "tool_n_a8f3", "arguments": {"key_b9d4": "val_d6e7"}}}]
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "name": "tool_n_a8f3", "content": "out_c4f9"},
    ]
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
    except Exception:
        return False
    return all(s in text for s in ("tool_n_a8f3", "key_b9d4", "val_d6e7", "out_c4f9"))


def with_tools(prompts: PromptSet, box: Toolbox, tokenizer: Any, room: int, what: str) -> PromptSet:
    """The prompts rendered again with the tools (apply_chat_template(tools=...), the generation
    prompt added), as TRL tokenizes them; room: the most prompt tokens a record may have."""
    if not prompts.conversational:
        raise InputError(
            f"rl.tools: {what} holds text prompts; tools need conversations (prompt: [{{role, content}}])"
        )
    tools = box.tools(box.make("made once to render the prompts") if box.environment else None)
    rows = []
    for r in prompts.rows:
        try:
            ids = tokenizer.apply_chat_template(
                r.prompt, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as e:
            raise InputError(
                f"{r.where}: the chat template failed on these messages with the tools: {e}"
            ) from None
        if len(ids) > room:
            raise InputError(
                f"{r.where}: the prompt with the tools is {len(ids)} tokens; at most {room} leave room for a "
                "completion (data.max_seq_len and the model's positions, less rl.max_completion_length)"
            )
        rows.append(replace(r, ids=list(ids)))
    return replace(prompts, rows=rows)
