"""Config loading: YAML + dotted `KEY=VALUE` overrides -> `Config`, strictly.

Every problem is collected and reported at once, each naming its dotted key: unknown keys,
wrong types, values out of range, a key given twice in one mapping (YAML would keep the last one
silently), non-finite numbers (`.nan`, `.inf`, "nan") where a number is meant. The file must be
UTF-8 (a bad byte is named by line and offset).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .. import utf8
from ..errors import ConfigError, InputError
from ..optim.modes import MODES
from .preference import preference_problems
from .rl import rl_problems
from .schema import Config


def load_config(path: str | Path | None, overrides: Sequence[str] = (), base: dict | None = None) -> Config:
    """Read a YAML file (or start from `base`), apply overrides, build and validate the tree."""
    raw: dict = dict(base or {})
    source, problems = None, list[str]()
    if path is not None:
        source = str(path)
        raw, problems = read_yaml(Path(path))
    for ov in overrides:
        apply_override(raw, ov)
    cfg, more = build(Config, _without_null_steps(raw), "")
    problems += more + validate(cfg) + run_length(cfg, raw)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def read_yaml(path: Path) -> tuple[dict, list[str]]:
    """A config file -> (its mapping, problems that name a dotted key: duplicate keys)."""
    if not path.is_file():
        raise InputError(f"{path}: config file not found")
    try:
        text = utf8.decode(path.read_bytes(), str(path))
    except OSError as e:
        raise InputError(f"{path}: cannot read the config file: {e.strerror or e}") from None
    try:
        problems = duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), "")
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise InputError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if raw is None:
        return {}, problems
    if not isinstance(raw, dict):
        raise InputError(f"{path}: the top level must be a mapping of sections (model:, data:, ...)")
    return raw, problems


def duplicate_keys(node: yaml.Node | None, prefix: str) -> list[str]:
    """Keys given twice in one mapping, anywhere in the document (YAML would keep the last silently)."""
    problems: list[str] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            name = str(key.value)
            dotted = f"{prefix}{name}"
            if name in seen and name != "<<":  # `<<` merges an anchor; YAML allows several
                problems.append(f"{dotted}: duplicate key (lines {seen[name]} and {key.start_mark.line + 1})")
            seen.setdefault(name, key.start_mark.line + 1)
            problems += duplicate_keys(value, dotted + ".")
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            problems += duplicate_keys(item, f"{prefix.rstrip('.')}[{i}].")
    return problems


def apply_override(raw: dict, text: str) -> None:
    """`optim.lr=2e-5` -> raw['optim']['lr'] = 2e-5 (value parsed as YAML)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as lone surrogates
        raise InputError(
            f"override {text[: e.start]!r}...: not UTF-8 text (at character {e.start})"
        ) from None
    key, sep, value = text.partition("=")
    if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w.]*", key):
        raise InputError(f"override {text!r}: expected KEY=VALUE with a dotted key, e.g. optim.lr=2e-5")
    parts = key.split(".")
    node = raw
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise InputError(f"override {text!r}: {p} is not a section")
        node = nxt
    try:
        node[parts[-1]] = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        node[parts[-1]] = value


def build(cls: type, raw: Any, prefix: str) -> tuple[Any, list[str]]:
    """Build dataclass `cls` from `raw`, returning (instance, problems)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        return cls(), [f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {_kind(raw)}"]
    problems: list[str] = []
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            allowed = ", ".join(fields)
            problems.append(f"{prefix}{key}: unknown key (allowed: {allowed})")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        dotted = prefix + name
        tp = _optional_section(hints[name])
        if raw[name] is None and tp is not hints[name]:  # an optional section given as null
            values[name] = None
            continue
        if dataclasses.is_dataclass(tp):
            values[name], sub = build(typing.cast(type, tp), raw[name], dotted + ".")
            problems += sub
            continue
        item = _section_list(tp)
        if item is not None and isinstance(raw[name], list):
            values[name], sub = build_list(item, raw[name], dotted)
            problems += sub
            continue
        given = raw[name]
        if isinstance(given, bool) and "bools" in f.metadata:  # rl.scale_rewards: true/false as TRL maps them
            given = f.metadata["bools"][given]
        value, err = coerce(given, tp)
        if err:
            problems.append(f"{dotted}: {err}")
            continue
        problems += check_meta(dotted, value, f.metadata)
        values[name] = value
    return cls(**values), problems


def build_list(cls: type, raw: list, dotted: str) -> tuple[list, list[str]]:
    """A list of sections (data.path's sources): each item a mapping, or a string standing for
    {path: it}; problems name the item (`data.path[1].weight`)."""
    out, problems = [], []
    if not raw:
        return [], [f"{dotted}: an empty list (give at least one source)"]
    for i, item in enumerate(raw):
        if isinstance(item, str):
            item = {"path": item}
        obj, sub = build(cls, item, f"{dotted}[{i}].")
        out.append(obj)
        problems += sub
    return out, problems


def _section_list(tp: Any) -> type | None:
    """The section type of a `... | list[Section]` field, else None."""
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    for m in members:
        if typing.get_origin(m) is list:
            (item,) = typing.get_args(m)
            if dataclasses.is_dataclass(item):
                return typing.cast(type, item)
    return None


def _optional_section(tp: Any) -> Any:
    """`Section | None` -> Section (an optional section of the tree); any other type unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return tp


def coerce(value: Any, tp: Any) -> tuple[Any, str | None]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None, None
        inner = [a for a in args if a is not type(None)]
        first = None
        for a in inner:  # the first member the value fits (list[str] | str: a list, or one string)
            out, err = coerce(value, a)
            if err is None:
                return out, None
            first = first or err
        return None, first
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            return None, f"expected a list, got {_kind(value)}"
        out = []
        for v in value:
            c, err = coerce(v, item)
            if err:
                return None, f"list item {v!r}: {err}"
            out.append(c)
        return out, None
    if origin is dict:  # data.chat_template_kwargs: a mapping of names to YAML values
        return (
            (dict(value), None)
            if isinstance(value, dict)
            else (None, f"expected a mapping, got {_kind(value)}")
        )
    if tp is bool:
        return (
            (value, None)
            if isinstance(value, bool)
            else (None, f"expected true or false, got {_kind(value)}")
        )
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value, None
        if isinstance(value, float) and value.is_integer():
            return int(value), None
        return None, f"expected an integer, got {_kind(value)}"
    if tp is float:
        number = _float(value)
        if number is None:
            return None, f"expected a number, got {_kind(value)}"
        if not math.isfinite(number):  # .nan/.inf would pass every bound check below
            return None, f"expected a finite number, got {value!r}"
        return number, None
    if tp is str:
        return (value, None) if isinstance(value, str) else (None, f"expected a string, got {_kind(value)}")
    raise TypeError(f"unsupported config type {tp}")


def _float(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            return None
    return None


def check_meta(dotted: str, value: Any, meta: Mapping) -> list[str]:
    if value is None:
        return []
    if "choices" in meta and value not in meta["choices"]:
        return [f"{dotted}: {value!r} is not allowed (choose one of: {', '.join(meta['choices'])})"]
    if "min" in meta and value < meta["min"]:
        return [f"{dotted}: {value} is below the minimum {meta['min']}"]
    if "max" in meta and value > meta["max"]:
        return [f"{dotted}: {value} is above the maximum {meta['max']}"]
    if "gt" in meta and not value > meta["gt"]:
        return [f"{dotted}: {value} must be greater than {meta['gt']}"]
    return []


def validate(cfg: Config) -> list[str]:
    """Cross-field checks that a single field's metadata cannot express."""
    p = []
    for key in ("model.path", "data.path", "output.dir"):
        section, name = key.split(".")
        if not getattr(getattr(cfg, section), name):
            p.append(f"{key}: required")
    if cfg.rl is None and cfg.train.batch_size % cfg.train.micro_batch_size:
        p.append(
            f"train.batch_size: {cfg.train.batch_size} is not a multiple of "
            f"train.micro_batch_size ({cfg.train.micro_batch_size})"
        )
    if isinstance(cfg.data.path, list):
        p += [f"data.path[{i}].path: required" for i, src in enumerate(cfg.data.path) if not src.path]
    b = cfg.optim.betas
    if len(b) != 2 or not all(0.0 <= x < 1.0 for x in b):
        p.append(f"optim.betas: expected two numbers in [0, 1), got {b}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.engine.device):
        p.append(f"engine.device: {cfg.engine.device!r} is not allowed (auto, cpu, cuda or cuda:N)")
    keep = cfg.engine.keep_activations
    if isinstance(keep, str) and keep != "auto" or isinstance(keep, int) and keep < 0:
        p.append(
            f"engine.keep_activations: {keep!r} is not allowed (auto, or a number of layers >= 0; 0 recomputes every layer)"
        )
    tile = cfg.engine.seq_tile
    if (
        isinstance(tile, bool)
        or isinstance(tile, str)
        and tile != "auto"
        or isinstance(tile, int)
        and tile < 0
    ):
        p.append(f"engine.seq_tile: {tile!r} is not allowed (auto, or tokens per tile >= 0; 0: untiled)")
    if cfg.engine.link_gbps and cfg.engine.device not in ("cpu", "auto"):
        p.append("engine.link_gbps: only emulates a link with engine.device: cpu")
    if cfg.engine.link_chaos and cfg.engine.device not in ("cpu", "auto"):
        p.append("engine.link_chaos: is a CPU transport; it needs engine.device: cpu (or auto)")
    if cfg.engine.link_chaos and cfg.engine.link_gbps:
        p.append("engine.link_chaos: its copies have random delays; leave engine.link_gbps at 0 with it")
    mode = MODES.get(cfg.optim.memory)  # None: refused by its choices already
    p += mode.problems(cfg.engine.grad_dtype, cfg.lora is not None) if mode else []
    evals = [k for k in ("eval_path", "eval_fraction", "eval_split") if getattr(cfg.data, k)]
    if len(evals) > 1:
        p.append(f"data.{evals[1]}: give one of data.eval_path, eval_fraction and eval_split, not several")
    if cfg.train.eval_every and not (evals or cfg.train.samples):
        p.append(
            "train.eval_every: needs data.eval_fraction, data.eval_path or data.eval_split (or train.samples)"
        )
    p += preference_problems(cfg) + rl_problems(cfg)
    if cfg.lora is not None:
        t = cfg.lora.targets
        if not t or (isinstance(t, list) and not all(t)):
            p.append("lora.targets: give module names (e.g. [q_proj, v_proj]), a regex, or all-linear")
        elif isinstance(t, str):
            try:
                re.compile(t)
            except re.error as e:
                p.append(f"lora.targets: {t!r} is not a valid regular expression ({e})")
    return p


def run_length(cfg: Config, raw: dict) -> list[str]:
    """train.steps or train.epochs, exactly one (neither: steps' default). With epochs, steps is
    None until the data is known: train/length.py resolves it before anything reads it."""
    train = raw.get("train")
    train = train if isinstance(train, dict) else {}
    given = [k for k in ("steps", "epochs") if train.get(k) is not None]
    if len(given) == 2:
        return [
            "train.epochs: give train.steps or train.epochs, not both "
            "(an epoch is one pass over the training rows)"
        ]
    if given == ["epochs"]:
        cfg.train.steps = None  # type: ignore[assignment]  # resolved from the data, before any use
    elif "steps" in train and not given:  # `steps: null` and no epochs
        return ["train.steps: required (optimizer steps), or give train.epochs instead"]
    return []


def _without_null_steps(raw: dict) -> dict:
    """`train.steps: null` stands for "not given" (a config that gives train.epochs may say so)."""
    train = raw.get("train")
    if isinstance(train, dict) and "steps" in train and train["steps"] is None:
        return {**raw, "train": {k: v for k, v in train.items() if k != "steps"}}
    return raw


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)


def _kind(v: Any) -> str:
    return f"{type(v).__name__} {v!r}" if not isinstance(v, dict | list) else type(v).__name__
