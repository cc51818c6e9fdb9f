"""Prompts for generation (`horizon generate`, eval-time samples): JSONL records (or `--prompt`
texts) -> token ids, checked before any weight is loaded.

Each record holds exactly one of
    prompt      text, tokenized as the tokenizer does by default (its BOS included)
    messages    a conversation [{role, content}, ...], rendered with the tokenizer's chat template
                and its generation prompt, then tokenized without adding special tokens again
    input_ids   token ids, used as given
and may hold any other fields, which the output lines carry along.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .. import utf8
from ..errors import InputError

FIELDS = ("prompt", "messages", "input_ids")


@dataclass
class Prompt:
    record: dict  # the input line as read (its fields go to the output)
    ids: list[int]
    where: str  # "FILE line N" or "--prompt N", for messages


def model_eos_ids(hf: Path) -> list[int]:
    """A model's end-of-sequence ids, as transformers' generate takes them: its generation
    config's (generation_config.json), else config.json's; [] when neither names one."""
    for name in ("generation_config.json", "config.json"):
        f = Path(hf) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


def read_records(path: str | Path, what: str = "--prompts") -> list[tuple[dict, str]]:
    """(record, where) of every non-blank line; InputError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what}: {path} not found")
    text = utf8.decode(path.read_bytes(), str(path))
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path} line {n}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise InputError(f"{path} line {n}: a JSON object with one of {', '.join(FIELDS)} expected")
        out.append((rec, f"{path} line {n}"))
    if not out:
        raise InputError(f"{path}: no prompts (the file is empty)")
    return out


def encode(
    records: list[tuple[dict, str]], tokenizer, vocab: int, max_positions: int, where: str
) -> list[Prompt]:
    """Token ids of every record. where: the model (for the message when it has no tokenizer)."""
    out = []
    for rec, at in records:
        fields = [f for f in FIELDS if f in rec]
        if len(fields) != 1:
            found = f"both {fields[0]} and {fields[1]}" if len(fields) > 1 else "none of them"
            raise InputError(f"{at}: a prompt needs exactly one of {', '.join(FIELDS)} ({found})")
        kind = fields[0]
        if kind != "input_ids" and tokenizer is None:
            raise InputError(
                f"{at}: {kind!r} needs a tokenizer, and {where} has no tokenizer files: give input_ids"
            )
        ids = _ids(rec, kind, tokenizer, vocab, at)
        if not ids:
            raise InputError(f"{at}: the prompt is empty (0 tokens)")
        if len(ids) >= max_positions:
            raise InputError(
                f"{at}: the prompt is {len(ids)} tokens, longer than the model's {max_positions} positions allow "
                "(at least one must be left to generate)"
            )
        out.append(Prompt(rec, ids, at))
    return out


def _ids(rec: dict, kind: str, tokenizer, vocab: int, at: str) -> list[int]:
    """A prompt's ids, each inside the model's vocabulary (a token id past it would index past the
    embedding table: a tokenizer of another model, or given ids)."""
    ids = _tokens(rec, kind, tokenizer, at)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad and kind == "input_ids":
        raise InputError(f"{at}: input_ids holds {bad[0]}, outside the model's vocabulary [0, {vocab})")
    if bad:
        raise InputError(
            f"{at}: the tokenizer gives id {bad[0]}, outside the model's vocabulary [0, {vocab}): "
            "are the tokenizer files this model's?"
        )
    return ids


def _tokens(rec: dict, kind: str, tokenizer, at: str) -> list[int]:
    value = rec[kind]
    if kind == "prompt":
        if not isinstance(value, str):
            raise InputError(f"{at}: prompt must be a string")
        return list(tokenizer(value)["input_ids"])
    if kind == "messages":
        ok = isinstance(value, list) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in value
        )
        if not ok or not value:
            raise InputError(f"{at}: messages must be a non-empty list of {{role, content}} objects")
        if not getattr(tokenizer, "chat_template", None):
            raise InputError(f"{at}: messages need a chat template, and the tokenizer has none")
        try:
            text = tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja's errors, a template's raise_exception()
            raise InputError(f"{at}: the chat template failed on these messages: {e}") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InputError(f"{at}: input_ids must be a list of integers")
    return list(value)
