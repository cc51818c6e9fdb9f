"""Tensor tables: store names, HF names and shapes for each unit of an architecture.

Units are what moves as one buffer: `embed`, `layer.{i}` for each decoder layer, and `head`
(final norm, plus the LM head unless embeddings are tied, in which case the head reuses
`embed`). The four native families share the HF layout `model.layers.{i}.self_attn.q_proj.weight`;
a generic architecture's table is data in its spec (`arch.generic`): the in-memory tensors of each
unit, each filled by one or more checkpoint tensors.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from ..errors import InputError
from .generic_arch import GenericArch, Moe, Table, TensorRow
from .spec import ArchSpec

# Tensors that may appear in a checkpoint but carry no parameters we train.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class TensorName:
    name: str  # store name within its unit, e.g. "wq"
    hf: str  # HF name, e.g. "model.layers.3.self_attn.q_proj.weight"
    shape: tuple[int, ...]


def unit_names(spec: ArchSpec) -> list[str]:
    return ["embed"] + [f"layer.{i}" for i in range(spec.n_layers)] + ["head"]


def layer_tensors(spec: ArchSpec, i: int) -> list[TensorName]:
    h, q, kv, f = spec.hidden, spec.q_dim, spec.kv_dim, spec.intermediate
    p = f"model.layers.{i}."
    out = [TensorName("attn_norm", p + "input_layernorm.weight", (h,))]
    for short, proj, rows in (("q", "q_proj", q), ("k", "k_proj", kv), ("v", "v_proj", kv)):
        out.append(TensorName("w" + short, f"{p}self_attn.{proj}.weight", (rows, h)))
        if spec.qkv_bias:
            out.append(TensorName("b" + short, f"{p}self_attn.{proj}.bias", (rows,)))
    out.append(TensorName("wo", p + "self_attn.o_proj.weight", (h, q)))
    if spec.o_bias:
        out.append(TensorName("bo", p + "self_attn.o_proj.bias", (h,)))
    if spec.qk_norm:
        out.append(TensorName("q_norm", p + "self_attn.q_norm.weight", (spec.head_dim,)))
        out.append(TensorName("k_norm", p + "self_attn.k_norm.weight", (spec.head_dim,)))
    out.append(TensorName("mlp_norm", p + "post_attention_layernorm.weight", (h,)))
    for short, proj, shape in (
        ("gate", "gate_proj", (f, h)),
        ("up", "up_proj", (f, h)),
        ("down", "down_proj", (h, f)),
    ):
        out.append(TensorName("w_" + short, f"{p}mlp.{proj}.weight", shape))
        if spec.mlp_bias:
            out.append(TensorName("b_" + short, f"{p}mlp.{proj}.bias", (shape[0],)))
    return out


def generic_table(spec: ArchSpec, unit: str) -> Table:
    """A generic unit's in-memory tensors (arch.generic_arch.TensorRow: name, hf, shape, trainable,
    parts, and `after` for a tensor that shares the region of the one before: arch.disk's
    groups), layer names filled in."""
    g = spec.generic
    assert g is not None
    if unit in ("embed", "head"):
        return g.units.of(unit)
    i = int(unit.split(".")[1])
    return tuple(e.at_layer(i) for e in g.layer_table(i))


def part_name(entry: TensorRow, k: int) -> str:
    """Store name of the k-th checkpoint tensor of an in-memory tensor."""
    return entry.name if len(entry.parts) == 1 else f"{entry.name}[{k}]"


def unit_tensors(spec: ArchSpec, unit: str) -> list[TensorName]:
    """The checkpoint tensors a unit holds, in store order."""
    return spec.pick(_native_unit, _generic_unit)(spec, unit)


def _native_unit(spec: ArchSpec, unit: str) -> list[TensorName]:
    return [_on_disk(spec, t) for t in _native_tensors(spec, unit)]


def _generic_unit(spec: ArchSpec, unit: str) -> list[TensorName]:
    return [
        TensorName(part_name(e, k), p.hf, p.shape)
        for e in generic_table(spec, unit)
        for k, p in enumerate(e.parts)
    ]


def _native_tensors(spec: ArchSpec, unit: str) -> list[TensorName]:
    if unit == "embed":
        return [TensorName("embed", "model.embed_tokens.weight", (spec.vocab, spec.hidden))]
    if unit == "head":
        out = [TensorName("norm", "model.norm.weight", (spec.hidden,))]
        if not spec.tie_embeddings:
            out.append(TensorName("lm_head", "lm_head.weight", (spec.vocab, spec.hidden)))
        return out
    return layer_tensors(spec, int(unit.split(".")[1]))


LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def _template(hf: str) -> tuple[str, str | None]:
    """(the name with its layer index as `{i}`, the index) for a native layer tensor."""
    m = LAYER.match(hf)
    return (f"model.layers.{{i}}.{m.group(2)}", m.group(1)) if m else (hf, None)


def _on_disk(spec: ArchSpec, t: TensorName) -> TensorName:
    """The tensor under its checkpoint name (spec.hf_names: a native class saved under other names)."""
    if not spec.hf_names:
        return t
    key, i = _template(t.hf)
    disk = spec.hf_names.get(key)
    if disk is None:
        return t
    return replace(t, hf=disk if i is None else disk.replace("{i}", i))


def native_disk_names(
    spec: ArchSpec, cfg: dict, disk: dict[str, tuple[int, ...]], where: str
) -> dict[str, str]:
    """For a native class whose checkpoint names differ from the Llama layout (EXAONE saves
    `transformer.h.N.attn.attention.q_proj`): each native name template -> its disk name template,
    through the renamings transformers applies when it loads that class; {} when they agree."""
    from transformers.core_model_loading import rename_source_key

    from .disk import transforms
    from .generic import meta_model, model_class

    table = {t.hf for u in unit_names(spec) for t in _native_tensors(spec, u)}
    if all(n in disk for n in table):
        return {}
    renamings, converters = transforms(meta_model(cfg, "eager", model_class(cfg, where).__name__))
    out: dict[str, str] = {}
    for name in disk:
        target, _ = rename_source_key(name, renamings, converters)
        if target in table and target != name:
            key, i = _template(target)
            tmpl = (
                name if i is None else re.sub(rf"(^|\.){i}\.", lambda m: m.group(1) + "{i}.", name, count=1)
            )
            if out.setdefault(key, tmpl) != tmpl:
                raise InputError(f"{where}: tensor {name}: its layers are not named alike in the checkpoint")
    return out


def hf_table(spec: ArchSpec) -> dict[str, tuple[str, TensorName]]:
    """HF name -> (unit, tensor) for every tensor the checkpoint must hold."""
    return {t.hf: (u, t) for u in unit_names(spec) for t in unit_tensors(spec, u)}


def is_ignorable(hf_name: str, spec: ArchSpec) -> bool:
    """Checkpoint entries we may skip: RoPE caches, and a duplicate lm_head of a tied model. A
    generic spec was built from the checkpoint's own names (arch.disk): what it left out is skippable."""
    return hf_name.endswith(IGNORED_SUFFIXES) or spec.pick(_tied_head, _left_out)(hf_name, spec)


def _tied_head(hf_name: str, spec: ArchSpec) -> bool:
    return spec.tie_embeddings and hf_name == "lm_head.weight"


def _left_out(hf_name: str, spec: ArchSpec) -> bool:
    return True


def param_split(spec: ArchSpec) -> dict[str, int]:
    """Parameters: dense (everything outside the routed experts, embeddings included), experts, and
    active per token (dense + top-k of the E experts' share)."""
    total = 0
    for u in unit_names(spec):
        total += sum(math.prod(t.shape) for t in unit_tensors(spec, u))
    g = spec.generic
    experts = expert_params(g) if g is not None else 0
    moe = g.moe if g is not None else None
    active = total - experts + (experts * moe.top_k // moe.n_experts if moe else 0)
    return {"dense": total - experts, "experts": experts, "active": active, "total": total}


def expert_params(g: GenericArch) -> int:
    """Parameters inside the routed experts (stacked over the expert dimension)."""
    moe = g.moe
    if not moe:
        return 0
    return sum(
        math.prod(e.shape) for k in g.layer_kinds for e in g.kinds[k] if is_expert(e.name, e.shape, moe)
    )


def is_expert(name: str, shape: tuple[int, ...], moe: Moe | None) -> bool:
    """A routed expert tensor: under `experts`, stacked over the expert dimension."""
    if not moe:
        return False
    return ".experts." in f".{name}" and len(shape) >= 2 and shape[0] == moe.n_experts
