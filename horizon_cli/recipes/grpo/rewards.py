"""Reward functions of an `rl:` run, called as TRL 1.16's GRPOTrainer calls them:

    f(prompts=[...], completions=[...], completion_ids=[[...]], trainer_state=..., **columns)
        -> one float (or None: "no reward for this one") per completion

`prompts` as the records hold them (text, or message lists), `completions` text (a message list
[{"role": "assistant", "content": text}] for conversational prompts), every other column of the
records as a keyword list, one entry per completion; `trainer_state` has `global_step` (the step
being trained, from 0). A function is a built-in name, "path/to/file.py:name" (imported from the
file, relative to the working directory) or "package.module:name".

Built-ins:
    accuracy  1.0 when math-verify finds the completion's answer equal to the record's solution
              (column `solution`, else `answer`, or rl.rewards[i].column), as open-r1 checks it;
              None when the solution does not parse (needs the `rl` extra: math-verify)
    format    1.0 when the whole completion matches rl.rewards[i].pattern (re.fullmatch, DOTALL)
    length    1.0 within target +- tolerance tokens, falling linearly to 0 at a distance of
              target beyond the tolerance

A function may be `async def` (the async ones are awaited together, as TRL does), and may take
`log_metric(name, value)` (the step's metrics get the mean) and `log_extra(column, values)` (a column
of rollouts/step-N.jsonl); `trainer_state` is a transformers TrainerState (global_step, max_steps,
epoch, ...). A reward file's own folder is importable (`from helper import score` beside it).

A function that raises, returns the wrong number of values, NaN or a non-number stops the run with
one line naming it and the sample (InputError, exit 2) before the step trains.

A reward may instead be a reward model (`model:` a converted sequence-classification store,
recipes.grpo.reward_model): `score` leaves its values NaN and recipes.grpo.batches fills them
from one forward sweep over the whole batch, after the ranks' rollouts are gathered.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config.schema import DataConfig, RewardConfig
from ...errors import InputError
from .reward_model import RewardModel


@dataclass
class Reward:
    name: str  # its metric name: rewards/<name>/mean
    weight: float
    fn: Callable
    key: str  # rl.rewards[i], for messages
    model: RewardModel | None = None  # a reward model (fn unused): recipes.grpo.batches scores it


def load_rewards(cfgs: list[RewardConfig], data_cfg: DataConfig | None = None) -> list[Reward]:
    out = []
    for i, r in enumerate(cfgs):
        key = f"rl.rewards[{i}]"
        if r.model is not None:  # its store and tokenizer checked now, its engine built at attach
            rm = RewardModel(r.model, key, data_cfg or DataConfig())
            out.append(Reward(r.name or rm.name, r.weight, _unused, key, rm))
            continue
        fn = _builtin(r, key) if ":" not in r.function else _import(r.function, key)
        name = r.name or (r.function if ":" not in r.function else r.function.rpartition(":")[2])
        out.append(Reward(name, r.weight, fn, key))
    names = [r.name for r in out]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise InputError(f"rl.rewards: two rewards are named {twice!r} (give one a name:)")
    return out


def _unused(**kw: object) -> list[float]:
    raise AssertionError("a reward model is scored by recipes.grpo.batches, not called")


def _import(spec: str, key: str, field: str = ".function") -> Callable:
    """`spec`'s object; messages name `key` + `field` (rl.tools: the key alone)."""
    mod, _, name = spec.rpartition(":")
    key += field
    try:
        if mod.endswith(".py"):
            path = Path(mod)
            if not path.is_file():
                raise InputError(
                    f"{key}: {mod} does not exist (a reward file, relative to the working directory)"
                )
            folder = str(path.resolve().parent)  # `from helper import x` beside the file, as python rw.py
            if folder not in sys.path:
                sys.path.insert(0, folder)
            unit = f"horizon_reward_{abs(hash(str(path.resolve())))}"
            s = importlib.util.spec_from_file_location(unit, path)
            assert s is not None and s.loader is not None
            m = importlib.util.module_from_spec(s)
            sys.modules[unit] = m
            s.loader.exec_module(m)
        else:
            m = importlib.import_module(mod)
    except InputError:
        raise
    except Exception as e:
        raise InputError(f"{key}: importing {mod} failed: {type(e).__name__}: {e}") from None
    fn = getattr(m, name, None)
    if not callable(fn):
        raise InputError(f"{key}: {mod} has no function {name!r}")
    return fn


def _builtin(r: RewardConfig, key: str) -> Callable:
    if r.function == "format":
        try:
            rx = re.compile(r.pattern or "", re.DOTALL)
        except re.error as e:
            raise InputError(
                f"{key}.pattern: {r.pattern!r} is not a valid regular expression ({e})"
            ) from None
        return lambda completions, **kw: [1.0 if rx.fullmatch(_text(c)) else 0.0 for c in completions]
    if r.function == "length":
        target, tol = r.target or 1, r.tolerance

        def length(completion_ids: list[list[int]], **kw: list) -> list[float]:
            return [max(0.0, 1.0 - max(0, abs(len(c) - target) - tol) / target) for c in completion_ids]

        return length
    if r.function == "accuracy":
        return _accuracy(r.column, key)
    raise InputError(f"{key}.function: unknown built-in {r.function!r}")


def _accuracy(column: str | None, key: str) -> Callable:
    try:
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        raise InputError(
            f"{key}.function: the accuracy reward needs math-verify: pip install 'horizon-cli[rl]'"
        ) from None

    def accuracy(completions: list, **kw: list) -> list[float | None]:
        col = column or next((c for c in ("solution", "answer") if c in kw), None)
        if col is None or col not in kw:
            raise ValueError(f"the records have no {column or 'solution or answer'} column")
        out: list[float | None] = []
        for c, sol in zip(completions, kw[col], strict=True):
            gold = parse(str(sol))
            if not gold:
                out.append(None)  # a solution that does not parse: no reward (open-r1, TRL)
                continue
            got = parse(_text(c), extraction_config=[LatexExtractionConfig()], extraction_mode="first_match")
            out.append(float(verify(gold, got)))
        return out

    return accuracy


def _text(c: str | list[dict[str, str]]) -> str:
    return c[0]["content"] if isinstance(c, list) else c


def score(
    rewards: list[Reward],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    step: int,
    where: Callable[[int], str],
    state: object = None,
    logs: dict | None = None,
) -> list[list[float]]:
    """Per reward function, one value per completion (NaN for None). where(k): completion k named.
    state: the TrainerState the functions get (None: one at `step`); logs: filled with what they
    pass to log_metric ({"metrics": {name: [values]}}) and log_extra ({"extra": {column: values}}).
    `async def` functions run together (asyncio.gather), as TRL awaits them."""
    from transformers import TrainerState

    state = state if state is not None else TrainerState(global_step=step)
    logs = logs if logs is not None else {}
    metrics, extra = logs.setdefault("metrics", {}), logs.setdefault("extra", {})
    hooks = {
        "log_metric": lambda name, value: metrics.setdefault(name, []).append(value),
        "log_extra": lambda column, values: extra.setdefault(column, []).extend(values),
    }
    n = len(completions)
    calls: list[Callable[[list[int]], object]] = []
    pending: dict[int, object] = {}
    for i, r in enumerate(rewards):
        if r.model is not None:  # scored apart (a forward sweep over the batch): NaN until then
            calls.append(lambda ks: None)
            pending[i] = [None] * n
            continue

        def call(ks: list[int], r: Reward = r) -> object:  # values, or an awaitable of them (async)
            return r.fn(
                prompts=[prompts[k] for k in ks],
                completions=[completions[k] for k in ks],
                completion_ids=[completion_ids[k] for k in ks],
                trainer_state=state,
                **hooks,
                **{c: [v[k] for k in ks] for c, v in columns.items()},
            )

        calls.append(call)
        try:
            got = call(list(range(n)))
        except Exception as e:
            _raised(r, e, call, n, step, where)
        pending[i] = got
    waiting = [i for i, g in pending.items() if inspect.isawaitable(g)]
    if waiting:
        done = asyncio.run(_gather([pending[i] for i in waiting]))
        for i, got in zip(waiting, done, strict=True):
            if isinstance(got, Exception):
                _raised(rewards[i], got, calls[i], n, step, where)
            pending[i] = got
    return [_checked(r, pending[i], n, step, where) for i, r in enumerate(rewards)]


async def _gather(coros: list[Any]) -> list[Any]:  # a user's coroutines
    return await asyncio.gather(*coros, return_exceptions=True)


def _raised(
    r: Reward,
    e: BaseException,
    call: Callable[[list[int]], object],
    n: int,
    step: int,
    where: Callable[[int], str],
) -> None:
    bad = _first_failing(call, n)
    at = f" on {where(bad)}" if bad is not None else f" on the batch of step {step + 1}"
    raise InputError(f"{r.key} ({r.name}): raised {type(e).__name__}: {e}{at}") from None


def _checked(r: Reward, got: Any, n: int, step: int, where: Callable[[int], str]) -> list[float]:
    """A function's values checked: n numbers (None -> NaN), finite."""
    what = f"{r.key} ({r.name})"
    try:
        vals = list(got)
    except TypeError:
        raise InputError(f"{what}: returned {type(got).__name__}, not a list of numbers") from None
    if len(vals) != n:
        raise InputError(f"{what}: returned {len(vals)} values for {n} completions (step {step + 1})")
    row = []
    for k, v in enumerate(vals):
        if v is None:
            row.append(math.nan)
            continue
        if not hasattr(v, "__float__"):  # int, float, bool, numpy and torch scalars
            raise InputError(f"{what}: returned {v!r} (not a number) for {where(k)}")
        f = float(v)
        if math.isnan(f):
            raise InputError(f"{what}: returned NaN for {where(k)} (return None for no reward)")
        if math.isinf(f):
            raise InputError(f"{what}: returned {f} for {where(k)} (a reward must be finite)")
        row.append(f)
    return row


def _first_failing(call: Callable[[list[int]], object], n: int) -> int | None:
    """The first completion a function raises on when called on it alone (awaited if async)."""
    for k in range(n):
        try:
            got = call([k])
            if inspect.isawaitable(got) and isinstance(asyncio.run(_gather([got]))[0], Exception):
                return k
        except Exception:
            return k
    return None
