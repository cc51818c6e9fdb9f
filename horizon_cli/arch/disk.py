"""Checkpoint names on disk -> transformers' in-memory parameters, for the generic path.

transformers v5 keeps some tensors otherwise in memory than checkpoints store them, and declares
each conversion as data (`conversion_mapping.py`: renamings, and converters made of operations):
`mlp.experts.gate_up_proj` (E, 2I, H) is stacked from every expert's `gate_proj` (I, H) and
`up_proj` (I, H) (`MergeModulelist(dim=0)` + `Concatenate(dim=1)`; Mixtral's
`block_sparse_moe.experts.N.w1` / `w3`); OLMo-Hybrid's q / k / v convolutions are concatenated
into one `conv1d` (`Concatenate(dim=0)`); Sarvam-MoE's fused `query_key_value` rows are split
into `q_proj`, `k_proj`, `v_proj` (`Split(dim=0)`), LaraMini's `in_proj` into four projections.
This module reads the same declarations, follows each converter's operations on the disk
tensors' element ranges (arch.runs) and turns the result into a *placement*: the memory tensors a
converter fills, laid out back to back in its target order (a *group*: one memory tensor unless
a split makes several), and where each disk tensor's elements sit in that group's flat buffer.
The store can hold it when every disk tensor comes out as one contiguous range: then the disk
tensors are the store's tensors, the memory tensors zero-copy views of them, and export writes
the disk tensors unchanged (bitwise round trip), which is what transformers' reverse conversion
on save (the inverse operations) writes too. A checkpoint already in the memory layout maps 1:1.
Any other conversion (a transpose, an interleave, a split that cuts a disk tensor's rows) is
refused, naming its operations.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import InputError
from . import runs as R

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Part:
    """One disk tensor inside a memory tensor's region: its elements are [at, at + numel) of the
    flat region, row-major. A region is one memory tensor's, or a group's (the memory tensors a
    split fills, back to back), held by the group's first tensor."""

    hf: str  # name on disk
    shape: tuple[int, ...]
    at: int


def transforms(model) -> tuple[list, list]:
    """(renamings, converters) transformers applies when loading `model` (a meta model)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    every = get_model_conversion_mapping(model)
    renamings = [t for t in every if isinstance(t, WeightRenaming)]
    converters = [t for t in every if isinstance(t, WeightConverter)]
    return renamings, converters


def place(
    model,
    mem: dict[str, tuple[int, ...]],
    disk: dict[str, tuple[int, ...]] | None,
    where: str,
    skip: frozenset[str] = frozenset(),
) -> tuple[dict[str, list[Part]], dict[str, str]]:
    """(memory name -> the disk tensors that fill its region, in order; memory name -> the one it
    follows without a gap, for the second and later tensors of a group, whose parts are empty).
    `disk`: name -> shape of every tensor in the checkpoint (None: assume the memory layout, e.g.
    for a config-only plan); `skip`: names to pass over (a tied model's duplicate LM head). Raises
    InputError naming the first unexpected, misshapen or missing tensor, or the conversion the
    store cannot hold."""
    if disk is None:
        return {k: [Part(k, s, 0)] for k, s in mem.items()}, {}
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters = transforms(model)
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    parts: dict[str, list[Part]] = {k: [] for k in mem}
    follows: dict[str, str] = {}
    # one converter instance per first target, as transformers collects them: pattern -> disk tensors
    pending: dict[tuple[int, str], dict[str, list[tuple[str, tuple[int, ...]]]]] = {}
    for name in sorted(disk, key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10
        shape = tuple(disk[name])
        if name in mem and name not in skip:  # before the ignore patterns (GPT-2's "attn.bias" is a regex)
            parts[name].append(_whole(name, shape, mem[name], where))
            continue
        if name in skip or name.endswith(IGNORED_SUFFIXES) or any(p.search(name) for p in ignore):
            continue
        target, pattern = rename_source_key(name, renamings, converters)
        if target not in mem:
            raise InputError(f"{where}: unexpected tensor {name} for this architecture per config.json")
        if pattern is None:
            parts[target].append(_whole(name, shape, mem[target], where))
            continue
        k = next(i for i, c in enumerate(converters) if pattern in c.source_patterns)
        pending.setdefault((k, target), {}).setdefault(pattern, []).append((name, shape))
    groups: list[list[str]] = []
    for (k, first), srcs in pending.items():
        group, placed = _group(converters[k], first, srcs, mem, model.config, where)
        for m in group[1:]:
            if parts[m] or m in follows or any(m in g for g in groups):
                raise InputError(f"{where}: {m} is doubled in the checkpoint (filled by {placed[0].hf} too)")
            follows[m] = group[group.index(m) - 1]
        parts[group[0]] += placed
        groups.append(group)
    heads = {g[0]: g for g in groups}
    for name, ps in parts.items():
        if name not in follows:
            members = heads.get(name, [name])
            _check_tiled(" + ".join(members), ps, sum(math.prod(mem[m]) for m in members), where)
    return parts, follows


def _group(conv, first: str, srcs: dict, mem: dict, config, where: str) -> tuple[list[str], list[Part]]:
    """Follow the converter on its disk tensors' runs: the memory tensors it fills in layout order,
    and the disk tensors placed in their joint region; InputError when the store cannot hold them."""
    ops = " + ".join(repr(op) for op in conv.operations)
    disk = {n: s for items in srcs.values() for n, s in items}
    lead = next(iter(disk))
    absent = [p for p in conv.source_patterns if p not in srcs]

    def misshapen(detail: str) -> InputError:
        if absent:  # e.g. every expert's up_proj missing
            return InputError(f"{where}: {first} is incomplete in the checkpoint (no tensor {absent[0]})")
        return InputError(f"{where}: {detail}")

    def refuse(why: str) -> InputError:
        return InputError(
            f"{where}: tensor {lead} needs the checkpoint conversion {ops}, which the store cannot hold "
            f"as a view ({why}; supported: stacking, concatenating, splitting and chunking that keep "
            "every disk tensor contiguous)"
        )

    try:
        out = _follow(
            conv, {p: [R.Sym.leaf(n, s) for n, s in items] for p, items in srcs.items()}, first, mem, config
        )
    except R.ShapeError as e:
        names = e.odd.names()
        if len(names) != 1:  # a stack or concatenation of several: some are missing
            raise misshapen(
                f"{first} is incomplete in the checkpoint (the conversion {ops} of {lead}, ... gives shape "
                f"{e.odd.shape} where {_shape(e.want)} is needed)"
            ) from None
        raise misshapen(
            f"tensor {names[0]} has shape {disk[names[0]]}, config.json implies {_shape(e.want)} "
            f"(the checkpoint conversion {ops})"
        ) from None
    except R.Unsupported as e:
        raise refuse(str(e)) from None
    for name, sym in out.items():
        if name not in mem:
            raise InputError(
                f"{where}: unexpected tensor {lead} for this architecture per config.json ({name})"
            )
        if sym.shape != tuple(mem[name]):
            raise misshapen(
                f"tensor {lead} has shape {disk[lead]}, config.json implies {name} of shape "
                f"{tuple(mem[name])} from it (the checkpoint conversion {ops} gives {sym.shape})"
            )
    runs = R.coalesce([r for sym in out.values() for r in sym.runs])
    placed, at, seen = [], 0, set()
    for name, first_el, count in runs:
        if name in seen or first_el != 0 or count != math.prod(disk[name]):
            raise refuse(f"{name} would not be contiguous in memory")
        seen.add(name)
        placed.append(Part(name, disk[name], at))
        at += count
    left = [n for n in disk if n not in seen]  # e.g. two disk tensors for one split
    if left:
        raise InputError(f"{where}: {first} is doubled in the checkpoint ({lead} and {left[0]})")
    return list(out), placed


def _shape(want) -> str:
    return "(" + ", ".join(str(w) for w in want) + ("," if len(want) == 1 else "") + ")"


def _follow(conv, collected: dict, first: str, mem: dict, config) -> dict[str, R.Sym]:
    """transformers' WeightConverter.convert, op by op, on runs: full memory name -> its runs."""
    sources, targets = list(conv.source_patterns), list(conv.target_patterns)
    for op in conv.operations:
        kind, dim = type(op).__name__, getattr(op, "dim", 0)
        if kind == "MergeModulelist":  # each pattern's list stacked (a single pattern: the target)
            if len(collected) == 1 and len(targets) != 1:
                raise R.Unsupported(f"{kind} to {len(targets)} targets")
            collected = {
                (targets[0] if len(collected) == 1 else p): (R.stack(v, dim) if isinstance(v, list) else v)
                for p, v in collected.items()
            }
        elif kind == "Concatenate":
            if len(targets) != 1:
                raise R.Unsupported(f"{kind} to {len(targets)} targets")
            every = [s for p in sources if p in collected for s in _listed(collected[p])]
            collected = {targets[0]: R.cat(every, dim)}
        elif kind in ("Split", "Chunk"):
            if len(collected) != 1:
                raise R.Unsupported(f"{kind} of {len(collected)} tensors")
            t = _listed(next(iter(collected.values())))[0]
            if kind == "Chunk":
                names = op.get_target_patterns(targets, config=config)
                pieces = R.chunk(t, dim, len(names))
            else:
                names = targets
                d = dim % max(len(t.shape), 1)
                sizes = [tuple(mem.get(first.replace(targets[0], n), ()))[d : d + 1] for n in names]
                if not all(sizes):
                    raise R.Unsupported(f"{kind}: a target is not a tensor of the model")
                pieces = R.split(t, dim, [s[0] for s in sizes])
            if len(pieces) != len(names):
                raise R.Unsupported(f"{kind} gives {len(pieces)} pieces for {len(names)} targets")
            collected = dict(zip(names, pieces, strict=True))
        else:
            raise R.Unsupported(f"{kind} is not a reordering of whole tensors")
    full = first.replace("*.", "0.") if "*." in first else first
    key = next((k for k in collected if k in full), None)
    if key is None:
        raise R.Unsupported("its result names no tensor of the model")
    prefix, _, suffix = full.partition(key)
    return {prefix + k + suffix: v if isinstance(v, R.Sym) else _listed(v)[0] for k, v in collected.items()}


def _listed(v) -> list:
    return v if isinstance(v, list) else [v]


def _whole(name: str, shape, want, where: str) -> Part:
    if tuple(shape) != tuple(want):
        raise InputError(
            f"{where}: tensor {name} has shape {tuple(shape)}, config.json implies {tuple(want)}"
        )
    return Part(name, tuple(shape), 0)


def _check_tiled(name: str, parts: list[Part], numel: int, where: str) -> None:
    """The parts cover the memory tensor (or group) exactly once."""
    if not parts:
        raise InputError(f"{where}: tensor {name} is missing from the checkpoint")
    parts.sort(key=lambda p: p.at)
    pos = 0
    for p in parts:
        if p.at != pos:
            raise InputError(
                f"{where}: {name} is incomplete or doubled in the checkpoint (at element {pos}: {p.hf})"
            )
        pos += math.prod(p.shape)
    if pos != numel:
        raise InputError(
            f"{where}: {name} is incomplete in the checkpoint ({pos} of {numel} elements present)"
        )
