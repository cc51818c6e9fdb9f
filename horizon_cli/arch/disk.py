"""Checkpoint names on disk -> transformers' in-memory parameters, for the generic path.

transformers v5 keeps some tensors fused in memory that Hub checkpoints store one per expert:
`mlp.experts.gate_up_proj` (E, 2I, H) is stacked from every expert's `gate_proj` (I, H) and
`up_proj` (I, H) (Mixtral: `block_sparse_moe.experts.N.w1` / `w3`), `mlp.experts.down_proj`
(E, H, I) from every `down_proj`. The library declares these conversions as data
(`conversion_mapping.py`: renamings, and converters made of `MergeModulelist` / `Concatenate`
operations); this module reads the same declarations and turns each into a *placement*: where a
disk tensor's elements sit inside the memory tensor's flat buffer. Stacking along dim 0 and then
concatenating along dim 1 keeps every disk tensor contiguous, so the store can hold the disk
tensors back to back and the fused parameter is a zero-copy view of them; export then writes the
disk tensors unchanged (bitwise round trip). A plain concatenation along dim 0 (OLMo-Hybrid's and
Bailing's q / k / v convolutions into one `conv1d`) keeps them contiguous too, in source order. A
checkpoint already in the memory layout maps 1:1. Any other conversion is refused, naming it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import InputError

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Part:
    """One disk tensor inside a memory tensor: its elements are [at, at + numel) of the flat
    memory tensor, row-major."""

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
) -> dict[str, list[Part]]:
    """Memory name -> the disk tensors that fill it, in order. `disk`: name -> shape of every
    tensor in the checkpoint (None: assume the memory layout, e.g. for a config-only plan);
    `skip`: names to pass over (a tied model's duplicate LM head). Raises InputError naming the
    first unexpected, misshapen or missing tensor."""
    if disk is None:
        return {k: [Part(k, s, 0)] for k, s in mem.items()}
    from transformers.core_model_loading import rename_source_key

    renamings, converters = transforms(model)
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    parts: dict[str, list[Part]] = {k: [] for k in mem}
    rows: dict[str, list[tuple[int, str, tuple[int, ...]]]] = {}  # dim-0 concatenations, by source
    for name, shape in disk.items():
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
        else:
            conv = next(c for c in converters if pattern in c.source_patterns)
            if _concat0(conv):
                rows.setdefault(target, []).append((conv.source_patterns.index(pattern), name, tuple(shape)))
                continue
            renamed = rename_source_key(name, renamings, [])[0]  # what the converter's pattern sees
            parts[target].append(_stacked(name, renamed, shape, mem[target], conv, pattern, where))
    for target, srcs in rows.items():  # back to back in source order
        at = 0
        for _, name, shape in sorted(srcs):
            if tuple(shape[1:]) != tuple(mem[target][1:]):
                raise InputError(
                    f"{where}: tensor {name} has shape {shape}, config.json implies (*, {mem[target][1:]})"
                )
            parts[target].append(Part(name, shape, at))
            at += math.prod(shape)
    for k, ps in parts.items():
        _check_tiled(k, ps, mem[k], where)
    return parts


def _concat0(conv) -> bool:
    ops = conv.operations
    return len(ops) == 1 and type(ops[0]).__name__ == "Concatenate" and getattr(ops[0], "dim", None) == 0


def _whole(name: str, shape, want, where: str) -> Part:
    if tuple(shape) != tuple(want):
        raise InputError(
            f"{where}: tensor {name} has shape {tuple(shape)}, config.json implies {tuple(want)}"
        )
    return Part(name, tuple(shape), 0)


def _stacked(name: str, renamed: str, shape, target: tuple[int, ...], conv, pattern: str, where: str) -> Part:
    """A per-expert disk tensor inside a stacked (and concatenated) memory tensor."""
    ops = [type(op).__name__ for op in conv.operations]
    dims = [getattr(op, "dim", None) for op in conv.operations]
    if (
        ops not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"])
        or dims[0] != 0
        or dims[1:] not in ([], [1])
    ):
        raise InputError(
            f"{where}: tensor {name} needs the checkpoint conversion {' + '.join(ops)}, which the store "
            "cannot hold as a view (supported: stacking per-expert tensors, then concatenating them on dim 1)"
        )
    # a plain pattern ("experts.*.w1") or, written as a regex, r"\.experts.*.w1": `*` is the index
    rx = pattern.replace("*", r"(\d+)") if "\\" in pattern else re.escape(pattern).replace(r"\*", r"(\d+)")
    m = re.search(rx, name) or re.search(rx, renamed)
    if m is None or not m.groups():
        raise InputError(f"{where}: tensor {name}: cannot tell its expert index")
    e, k, n_src = int(m.group(1)), conv.source_patterns.index(pattern), len(conv.source_patterns)
    rows = target[1] // n_src if len(target) > 1 else 0
    want = (rows, *target[2:])
    if len(target) < 2 or target[1] % n_src or tuple(shape) != want or e >= target[0]:
        raise InputError(
            f"{where}: tensor {name} has shape {tuple(shape)}, config.json implies {want} "
            f"(expert {e} of {target[0]})"
        )
    per_expert = math.prod(target[1:])
    return Part(name, tuple(shape), e * per_expert + k * math.prod(want))


def _check_tiled(name: str, parts: list[Part], shape: tuple[int, ...], where: str) -> None:
    """The parts cover the memory tensor exactly once."""
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
    if pos != math.prod(shape):
        raise InputError(
            f"{where}: {name} is incomplete in the checkpoint ({pos} of {math.prod(shape)} elements present)"
        )
