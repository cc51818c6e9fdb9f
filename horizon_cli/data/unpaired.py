"""Unpaired preference (KTO): a record -> (prompt, completion, desirable) token ids, as TRL's
KTOTrainer tokenizes them (trl/trainer/kto_trainer.py, `_prepare_dataset`), and the rows the KTO
objective (recipes.kto.loss) reads.

    TRL unpaired        prompt, completion: strings (the tokenizer's EOS appended to a completion
                        that does not end with it) or message lists (the chat template renders the
                        prompt with the generation prompt, and prompt + completion); label: bool
    LLaMA-Factory alpaca     instruction, input, output, kto_tag (bool); optional system, history
    LLaMA-Factory sharegpt   conversations / messages (the last message is the completion, an
                             assistant's; the earlier ones the prompt), kto_tag (bool); optional
                             system, tools

The completion starts where the tokenized prompt and prompt + completion part (TRL's
`common_prefix_length`). A label or kto_tag that is not a boolean, or a missing completion, is an
error naming the record; an empty completion is skipped.

The KL term (TRL): each example also gets a mismatched completion, the completions rotated by one
within each block of `group` examples in dataset order (TRL's `add_kl_completion_ids` over batches
of per_device_train_batch_size): (x1, y1), ..., (xn, yn) -> (x1, yn), (x2, y1), ..., (xn, yn-1).
Example k is rows 2k (prompt + its completion) and 2k + 1 (prompt + the mismatched completion),
labels on the completions, each sequence cut to max_seq_len (TRL's collator); an example whose
prompt alone fills max_seq_len is dropped before the rotation, as TRL drops it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError
from . import templates
from .batch import IGNORE, MicroBatch
from .cache import Wrap
from .encode import NoTokenizer
from .fields import Unread, unread_columns
from .pairs import PairPayload, collate_pairs
from .records import chat_record, instruction_record, text_of, tools_of, turns_of
from .tokset import MediaBuilder, Row, RowBuilder, TokenSet

# form -> the fields it reads
FORMS: dict[str, tuple[str, ...]] = {
    "trl": ("prompt", "completion", "label", "tools"),
    "alpaca": ("instruction", "input", "output", "kto_tag", "system", "history"),
    "sharegpt": ("conversations", "messages", "kto_tag", "system", "tools"),
}


@dataclass
class Example:
    prompt: np.ndarray  # (P,) int32
    completion: np.ndarray  # (C,) int32
    desirable: bool


def unpaired_form(columns: list[str]) -> str | None:
    """Which unpaired form a dataset's fields are, or None when they are not unpaired preference."""
    if "kto_tag" in columns:
        return "sharegpt" if ("conversations" in columns or "messages" in columns) else "alpaca"
    if "label" in columns and "completion" in columns:
        return "trl"
    return None


def desirable_of(rec: dict, form: str, where: str) -> bool:
    """The record's label (TRL) or kto_tag (LLaMA-Factory): a boolean, else an error naming it."""
    tag = "label" if form == "trl" else "kto_tag"
    desirable = rec.get(tag)
    if not isinstance(desirable, bool | np.bool_):
        shown = "missing" if desirable is None else f"{desirable!r}"
        raise InputError(f"{where}: {tag} must be true or false (desirable or not), got {shown}")
    return bool(desirable)


def encode(rec: dict, form: str, tok, where: str) -> Example | None:
    """One record -> its Example, or None for an empty completion."""
    desirable = desirable_of(rec, form, where)
    chat = templates.chat_template_of(tok) is not None
    tools = tools_of(rec.get("tools"), where)
    if form == "trl":
        if rec.get("completion") is None:
            raise InputError(f"{where}: has no 'completion'")
        prompt, comp = (_value(rec.get(k), k, where) for k in ("prompt", "completion"))
        if isinstance(prompt, list) != isinstance(comp, list):
            raise InputError(f"{where}: prompt and completion must both be strings or both message lists")
    elif form == "alpaca":
        ins = instruction_record({**rec, "output": ""}, where)
        comp = text_of(rec.get("output"), "output", where)
        if chat:
            prompt, comp = ins.as_chat().messages[:-1], [{"role": "assistant", "content": comp}]
        else:
            prompt = templates.alpaca(ins).text
    else:
        msgs = chat_record(rec, where, Counter()).messages
        if not msgs or msgs[-1]["role"] != "assistant":
            raise InputError(f"{where}: the last message must be the assistant's completion")
        prompt, comp = msgs[:-1], msgs[-1:]
    if blank(comp):
        return None
    if isinstance(comp, list):
        if not chat:
            raise InputError(
                "tokenizer: conversational KTO records need a chat template, and this tokenizer has none"
            )
        p = _render(tok, prompt, tools, gen=True)
        pc = _render(tok, prompt + comp, tools)
    else:
        eos = tok.eos_token
        if eos and not comp.endswith(eos):
            comp = comp + eos
        p, pc = tok(text=prompt)["input_ids"], tok(text=prompt + comp)["input_ids"]
    n = 0
    while n < min(len(p), len(pc)) and p[n] == pc[n]:
        n += 1
    arr = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
    return Example(arr(p[:n]), arr(pc[n:]), bool(desirable))


def examples_of(ds, tok, name: str, adapt=None, ignore: frozenset = frozenset()) -> list[Example]:
    """Every record of a dataset of unpaired preference records -> Examples (empty ones skipped);
    the fields no form reads judged first (fields.py); `adapt`: a registry's message tags."""
    form = unpaired_form(list(ds.column_names))
    if form is None:
        raise InputError(f"{name}: no unpaired preference records (label or kto_tag with a completion)")
    if tok is None:  # train.inputs names the model's files
        raise NoTokenizer("unpaired")
    read = [c for c in ds.column_names if c in FORMS[form]]
    unread_columns(ds, read, Unread("unpaired", name, ignore))
    out, i = [], 0
    for batch in ds.select_columns(read).iter(batch_size=1000):
        batch = adapt(batch) if adapt else batch
        for k in range(len(next(iter(batch.values())))):
            i += 1
            ex = encode({c: v[k] for c, v in batch.items()}, form, tok, f"{name}: record {i}")
            if ex is not None:
                out.append(ex)
    return out


def build_unpaired(examples: list[Example], max_len: int, group: int) -> TokenSet:
    """Examples -> the rows KTO trains on (kto_rows of example_rows)."""
    return kto_rows(example_rows(examples, max_len), max_len, group)


def example_rows(examples: list[Example], max_len: int, stats: dict | None = None) -> TokenSet:
    """Examples -> TokenSet (format `unpaired`, what the cache keeps): one row per example, prompt +
    completion whole (cut later, with its mismatched row), stats["desirable"] the labels; an
    example whose prompt alone fills max_len is dropped (TRL drops it before the rotation)."""
    kept = [e for e in examples if fits(e, max_len)]
    rows = RowBuilder()
    for e in kept:
        lab = np.concatenate([np.full(len(e.prompt), IGNORE, np.int32), e.completion]).astype(np.int32)
        rows.add(np.concatenate([e.prompt, e.completion]).astype(np.int32), lab)
    out = {**(stats or {}), "examples": len(kept), "desirable": [bool(e.desirable) for e in kept]}
    out["dropped"] = len(examples) - len(kept)
    return rows.build("unpaired", out)


def fits(e: Example, max_len: int) -> bool:
    """The example is kept: its prompt alone does not fill max_len."""
    return len(e.prompt) < max_len


def kto_rows(ts: TokenSet, max_len: int, group: int, wrap: Wrap | None = None) -> TokenSet:
    """One row per example -> two (its completion, the mismatched one: TRL's rotation by one
    within blocks of `group` examples), each cut to max_len. Rows with image tensors (an
    ImageSet of vision.unpaired): both rows of an example carry the example's own (its prompt's
    images, which TRL's vision collator pairs with the mismatched completion too), the set given
    back through `wrap` (data.images.ImageData.wrap)."""
    n = len(ts)
    parts, media = [], MediaBuilder()
    for i in range(n):
        r = ts[i]
        media.add(r.media or {})
        media.add(r.media or {})
        p = int(np.argmax(r.labels != IGNORE)) if (r.labels != IGNORE).any() else len(r.labels)
        parts.append((r.input_ids[:p], r.input_ids[p:]))
    rows = RowBuilder()
    for a in range(0, n, max(group, 1)):
        block = parts[a : a + max(group, 1)]
        kl = [block[-1][1]] + [c for _, c in block[:-1]]
        for (prompt, comp), other in zip(block, kl, strict=True):
            for c in (comp, other):
                ids = np.concatenate([prompt, c]).astype(np.int32)[:max_len]
                lab = np.concatenate([np.full(len(prompt), IGNORE, np.int32), c]).astype(np.int32)
                rows.add(ids, lab[:max_len])
    stats = {k: v for k, v in ts.stats.items() if k not in ("tokens", "label_tokens", "rows")}
    if ts.index is not None:
        flags = np.asarray(ts.stats["desirable"], dtype=bool)[ts.index]
        stats["desirable"] = flags.tolist()
    out = rows.build("unpaired", stats)
    if not any(media.rows):  # no row holds an image (a text set, or an image set without any)
        return out
    assert wrap is not None, "rows with images are wrapped back by the image data"
    return wrap(out, *media.arrays())


def unpair(ds, name: str):
    """Preference pairs -> unpaired examples, as trl.data_utils.unpair_preference_dataset (which
    KTOTrainer applies to pairs): per block of 1,000 records (datasets' batched map) the chosen
    completions, label true, then the rejected, label false; the prompt and other fields repeated."""
    if "prompt" not in ds.column_names:
        raise InputError(
            f"{name}: KTO on preference pairs reads TRL's form (prompt, chosen, rejected); these pairs "
            "have no prompt field"
        )

    def split(b: dict) -> dict:
        n = len(b["chosen"])
        out = {k: v + v for k, v in b.items() if k not in ("chosen", "rejected")}
        return {**out, "completion": b["chosen"] + b["rejected"], "label": [True] * n + [False] * n}

    return ds.map(split, batched=True, batch_size=1000, remove_columns=ds.column_names, keep_in_memory=True)


def build_unpaired_set(ds, tok, data_cfg, name: str, log, adapt=None) -> TokenSet:
    """A dataset of unpaired preference records -> its example rows (the cached form), logged."""
    max_len = data_cfg.max_seq_len
    pairs = len(ds) if {"chosen", "rejected"} <= set(ds.column_names) else 0
    if pairs:
        ds = unpair(ds, name)
        log(
            f"data: {name}: {pairs} preference pairs unpaired as TRL's KTOTrainer does (chosen desirable, rejected not)"
        )
    examples = examples_of(ds, tok, name, adapt, frozenset(data_cfg.ignore_fields))
    ts = example_rows(examples, max_len, {"records": len(ds), "form": unpaired_form(list(ds.column_names))})
    des = sum(ts.stats["desirable"])
    dropped = ts.stats["dropped"]
    log(
        f"data: {name}: {len(ds)} records -> {len(ts)} examples ({des} desirable, {len(ts) - des} undesirable; "
        f"{ts.stats['form']} form)"
        + (f"; {dropped} dropped (the prompt fills max_seq_len)" if dropped else "")
    )
    if not len(ts):
        raise InputError(f"{name}: no unpaired preference example to train on")
    return ts


def collate_unpaired(
    rows: list[Row], desirable, micro: int, pad_id: int, ref: np.ndarray | None = None
) -> list[MicroBatch]:
    """Rows of a global batch of examples (completion, mismatched, ...) -> micro-batches of
    `micro` whole examples, each with its KTOPayload."""
    mbs = collate_pairs(rows, micro, pad_id, ref)
    flags = torch.as_tensor(np.asarray(desirable, dtype=bool))
    off = 0
    for mb in mbs:
        k = mb.input_ids.shape[0] // 2
        pairs = mb.payload
        assert isinstance(pairs, PairPayload)
        mb.payload = KTOPayload(ref=pairs.ref, desirable=flags[off : off + k], examples=len(rows) // 2)
        off += k
    return mbs


@dataclass(frozen=True)
class KTOPayload:
    """A micro-batch of KTO examples' payload (recipes.kto.loss reads it): the rows' reference
    log-probs (b,) fp32 (None before the reference pass), whether each example is desirable (b/2,)
    bool, and the global batch's examples (each has one mismatched row)."""

    ref: torch.Tensor | None
    desirable: torch.Tensor
    examples: int

    def unlabelled(self) -> KTOPayload:
        return self  # the global batch's count stays: the filler's examples are invalid, adding nothing


def _value(v, what: str, where: str):
    if not isinstance(v, list):
        return text_of(v, what, where)
    msgs, _ = turns_of(v, what, where, Counter())
    return msgs


def _render(tok, messages: list[dict], tools, gen: bool = False) -> list[int]:
    out = tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=gen, tools=tools
    )
    return list(out["input_ids"])


def blank(v) -> bool:
    """An empty completion (skipped): blank text, or messages with no content."""
    if isinstance(v, str):
        return not v.strip()
    return not v or all(not str(m.get("content") or "").strip() for m in v)
