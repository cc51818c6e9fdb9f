"""The generic path's architecture description, derived from transformers' own model class.

For a causal LM without a native functional layer, `generic_spec` builds the class the config
names (`architectures`, else transformers' causal-LM mapping) on the meta device (no memory, no
weights), observes its forward once (arch.probe) and records, as typed frozen data
(arch.generic_arch.GenericArch, which the store's manifest holds as JSON with a version):

  model   where the pieces are and how the forward runs around the layers (arch.probe: stack,
          owner, embedding, head, the modules before and after the layers, the logits mode,
          the layers it calls) — the generic template runs transformers' own code with it
  units   the tensor table of `embed`, each decoder layer and `head`: every in-memory parameter
          (and persistent buffer, e.g. DeepSeek-V3's `e_score_correction_bias`, kept frozen) with
          its shape, and the checkpoint tensors that fill it (arch.disk). The model-level tensors
          used before the first layer (learned positions, embedding norms, projections) travel
          with that layer's unit, the suffix's (final norms) and the head's bias with the head.
          Layers with the same table share a *kind*.
  carried tensors outside the language model (a multimodal checkpoint's vision or audio tower
          and projector, modules the text forward never calls): kept on disk as they are and
          exported back untouched (convert / export), never trained
  moe     experts, top-k, which layers route, and the auxiliary loss coefficient when on
  recurrent  the recurrent / linear-attention modules in the layers (packing refused for them)

Anything the path cannot do is refused before convert writes a byte, with one line naming the
feature (arch.exceptions, arch.probe). Loading a store reads this data back; stores written
before it (no `model`) are re-probed from their config once when loaded.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import InputError
from .calls import is_loop
from .disk import place
from .exceptions import refuse_config, refuse_layers, refuse_shared
from .generic_arch import DiskPart, GenericArch, Moe, Table, TensorRow, Units
from .probe import probe
from .structure import Stack
from .workset import measure

RECURRENT = re.compile(
    r"Mamba|Mixer|DeltaNet|DeltaAttention|LinearAttention|Lightning|ShortConv|Rglru|RgLru|Kda"
)


def hf_config(d: dict, attn: str | None = None):
    """A transformers config object from a config.json dict."""
    from transformers import CONFIG_MAPPING

    if d.get("model_type") not in CONFIG_MAPPING:
        raise InputError(f"model_type {d.get('model_type')!r} is not a transformers architecture")
    cls = CONFIG_MAPPING[d["model_type"]]
    cfg = cls.from_dict(cls._decode_special_floats(dict(d)))  # {"__float__": "Infinity"}, as from_pretrained
    if attn is not None:
        cfg._attn_implementation = attn
    return cfg


def model_class(cfg: dict, where: str):
    """The transformers class the checkpoint is: the first of `architectures` transformers has
    that carries an LM head, else what its causal-LM mapping builds for the model type."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mt = str(cfg.get("model_type"))
    for name in cfg.get("architectures") or []:
        cls = getattr(transformers, str(name), None)
        if isinstance(cls, type) and hasattr(cls, "get_output_embeddings") and _lm_class(name):
            return cls
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(mt)
    if name is None:
        arch = (cfg.get("architectures") or [mt])[0]
        raise InputError(f"{where}: {arch} (model_type {mt!r}) is not a causal LM in transformers")
    return getattr(transformers, name)


def _lm_class(name: str) -> bool:
    return name.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))


def attn_implementation(cls) -> str:
    """SDPA where the class supports it, else eager (soft-capped attention, sinks), as transformers picks."""
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def meta_model(cfg_dict: dict, attn: str | None = None, cls_name: str | None = None, dtype=None):
    """The model on the meta device: names, shapes and module structure, no memory; built with
    `dtype` (a torch dtype) the default, as transformers' from_pretrained builds a model of that
    dtype (buffers made without an explicit dtype take it: GPT's causal-mask `bias`; None: the
    config's own)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = hf_config(cfg_dict)
    for c in (cfg, cfg.get_text_config()):  # a checkpoint's `return_dict: false`: outputs by name still
        c.return_dict = True
    cls = getattr(transformers, cls_name) if cls_name else None
    kw: dict[str, Any] = {"attn_implementation": attn, **({"dtype": dtype} if dtype is not None else {})}
    with torch.device("meta"):
        if cls is None or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.model_type) == cls.__name__:
            model = AutoModelForCausalLM.from_config(cfg, **kw)
        else:
            model = cls._from_config(cfg, **kw)
    return model.eval()


def stored_model(g: GenericArch, dtype=None):
    """The meta-device model of a store's generic description (its class, config, attention)."""
    return meta_model(dict(g.config), g.attn, g.cls, dtype)


def generic_spec(cfg: dict, where: str, disk: dict[str, tuple[int, ...]] | None = None) -> GenericArch:
    """The `generic` block of an ArchSpec (see module doc). `disk`: the checkpoint's tensor names
    and shapes (None: a config-only description, assuming the in-memory layout)."""
    refuse_config(cfg, where)
    cls = model_class(cfg, where)
    attn = attn_implementation(cls)
    try:
        model = meta_model(cfg, attn, cls.__name__)
    except Exception as e:  # noqa: BLE001 (transformers' own checks: a padding id past the vocabulary, ...)
        why = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        raise InputError(
            f"{where}: transformers cannot build {cls.__name__} from this config: {why}"
        ) from None
    s = probe(model, where)
    layers = list(model.get_submodule(s.stack))
    refuse_layers(layers, list(s.calls), cls.__name__, where)
    moe = _moe(model, layers, where)
    if moe and is_loop(s.calls):
        raise InputError(
            f"{where}: {s.owner} runs routed (MoE) layers in a loop: router statistics per call are not supported"
        )
    refuse_shared(model, s.stack, where)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is emb.weight
    every = list(model.named_parameters(remove_duplicate=False))
    embed_name = next(n for n, p in every if p is emb.weight)
    head_weight = f"{s.head}.weight"
    mem = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if tied:
        mem.pop(head_weight, None)
    skip = frozenset({head_weight}) if tied else frozenset()
    parts, follows = place(model, mem, disk, where, skip)
    placed = {k: (v, follows.get(k)) for k, v in parts.items()}  # name -> (its parts, the one it follows)
    groups = _groups(model, s, mem, embed_name, head_weight, tied)
    trained = {n for n, _ in every}
    prefix_rows = [_entry("@" + n, n, mem, placed, n in trained) for n in groups.prefix]
    head_rows = [
        _entry("lm_head" if n == head_weight else "@" + n, n, mem, placed, n in trained) for n in groups.head
    ]
    units = Units(
        embed=_grouped([_entry("embed", embed_name, mem, placed, True)], where),
        head=_grouped(sorted(head_rows, key=lambda r: not r.trainable), where),
    )
    stack = s.stack
    kinds, layer_kinds = _layer_kinds(layers, stack, mem, placed, s.calls[0], prefix_rows, where)
    kinds = _mark_integers(model, kinds, layer_kinds)
    carried = tuple(p.hf for n in groups.carried for p in placed[n][0])
    return GenericArch(
        config=cfg,
        cls=cls.__name__,
        attn=attn,
        family=type(model).__name__,
        layer_class=type(layers[s.calls[0]]).__name__,
        prefix=stack + ".",
        model=s,
        units=units,
        kinds=kinds,
        layer_kinds=tuple(layer_kinds),
        carried=carried,
        moe=moe,
        recurrent=_recurrent(layers),
        workset=measure(model.get_submodule(s.owner), layers, s, layer_kinds, RECURRENT),
    )


def _recurrent(layers) -> tuple[str, ...]:
    """The recurrent / linear-attention module classes in the layers, by name."""
    return tuple(
        sorted(
            {type(m).__name__ for la in layers for m in la.modules() if RECURRENT.search(type(m).__name__)}
        )
    )


@dataclass
class _Groups:
    """The model-level tensors by where they go (module doc), in-memory names."""

    prefix: list[str] = field(default_factory=list)  # the first layer's unit
    head: list[str] = field(default_factory=list)
    carried: list[str] = field(default_factory=list)


def _groups(model, s: Stack, mem: dict, embed_name: str, head_weight: str, tied: bool) -> _Groups:
    """Which unit each model-level tensor belongs to (module doc); layers are taken by prefix."""
    stack, owner = s.stack + ".", s.owner + "."
    prefix_mods = [p + "." for p in s.prefix]  # the embedding module's own others too (Inkling's norm)
    suffix_mods = [p + "." for p in s.suffix]
    head_mod = s.head + "."
    out = _Groups()
    for n in mem:
        if n == embed_name or n.startswith(stack):
            continue
        own = n.startswith(owner) and "." not in n[len(owner) :]  # the owner's own (Zaya's input bias)
        if own or n.startswith(tuple(prefix_mods)):
            out.prefix.append(n)
        elif n.startswith(tuple(suffix_mods)) or n.startswith(head_mod):
            out.head.append(n)
        elif not n.startswith(s.base + ".") and s.logits == "forward":
            out.head.append(n)  # the CausalLM's own code after its base model uses it
        else:
            out.carried.append(n)  # towers, projectors, modules the text forward never calls
    if not tied and head_weight in out.head:  # the LM head's weight last, as "lm_head"
        out.head.remove(head_weight)
        out.head.append(head_weight)
    return out


def _entry(
    name: str, hf: str, mem: dict, parts: dict, trainable: bool, layer: tuple[str, int] | None = None
) -> TensorRow:
    """One tensor of a unit's table: its name for the engine, in-memory name, shape, and the disk
    tensors that fill it (`parts`: memory name -> (parts, the tensor it follows or None)). The
    second and later tensors of a group (arch.disk: a split of one disk tensor) name the one they
    follow without a gap (`after`) and have no parts of their own. In a layer kind, `{i}` stands
    for the layer index."""

    def tmpl(s: str, disk: bool) -> str:
        return s if layer is None else _templ(s, layer, disk)

    placed, after = parts[hf]
    return TensorRow(
        name=name,
        hf=tmpl(hf, False),
        shape=tuple(mem[hf]),
        trainable=trainable,
        parts=tuple(DiskPart(tmpl(p.hf, True), tuple(p.shape), p.at) for p in placed),
        after=None if after is None else tmpl(after, False),
    )


def _grouped(rows: list[TensorRow], where: str) -> Table:
    """The rows with each group's tensors together, in its order (after its first tensor's place)."""
    nxt = {r.after: r for r in rows if r.after is not None}
    out: list[TensorRow] = []
    for r in rows:
        if r.after is not None:
            continue
        out.append(r)
        while out[-1].hf in nxt:
            prev, out_r = out[-1], nxt[out[-1].hf]
            if out_r.trainable != prev.trainable:
                raise InputError(
                    f"{where}: {prev.hf} and {out_r.hf} come from one checkpoint tensor, but only "
                    "one of them is a parameter (the store cannot hold it)"
                )
            out.append(out_r)
    if len(out) != len(rows):
        lost = next(r for r in rows if r not in out)
        raise InputError(f"{where}: {lost.hf} comes from a checkpoint tensor another unit holds")
    return tuple(out)


def _templ(name: str, layer: tuple[str, int], disk: bool) -> str:
    """Replace the layer index in a tensor name with `{i}`: after the stack's path in memory, the
    first dotted number equal to it on disk (whose prefix may be renamed: `transformer.h.3.`)."""
    stack, i = layer
    key = f"{stack}.{i}."
    if not disk or name.startswith(key):
        if not name.startswith(key):
            raise InputError(f"tensor {name}: not in layer {i} of {stack}")
        return f"{stack}.{{i}}." + name[len(key) :]
    m = re.search(rf"(^|\.){i}\.", name)
    if m is None:
        raise InputError(f"tensor {name}: cannot find its layer index {i}")
    at = m.start() + len(m.group(1))
    return name[:at] + "{i}." + name[at + len(str(i)) + 1 :]


def _layer_kinds(
    layers, stack: str, mem: dict, parts: dict, first: int, prefix_rows: list[TensorRow], where: str
) -> tuple[dict[str, Table], list[str]]:
    """Per-layer tables, deduplicated into kinds ('k0', 'k1', ... in order of first use); the first
    layer the forward calls also holds the tensors used before it (prefix_rows, by full name)."""
    kinds: dict[str, Table] = {}
    keys: dict[Table, str] = {}
    layer_kinds = []
    for i, layer in enumerate(layers):
        params = [n for n, _ in layer.named_parameters()]
        buffers = [b for b in layer.state_dict() if b not in set(params)]
        rows = [
            _entry(n, f"{stack}.{i}.{n}", mem, parts, n in params, layer=(stack, i))
            for n in [*params, *buffers]
        ]
        if i == first:
            rows += prefix_rows
        rows.sort(key=lambda r: not r.trainable)  # frozen tensors last: the optimizer stops before them
        table = _grouped(rows, where)
        if table not in keys:
            keys[table] = f"k{len(kinds)}"
            kinds[keys[table]] = table
        layer_kinds.append(keys[table])
    return kinds, layer_kinds


def _mark_integers(model, kinds: dict[str, Table], layer_kinds: list[str]) -> dict[str, Table]:
    """A layer's integer buffers (DeepSeek-V4's frozen token -> expert table `tid2eid`) get their
    dtype in the table: the store's float units hold their values (small integers, exactly: convert
    checks), the layer gets them back in that dtype, export writes them in it."""
    ints = {k: str(v.dtype).removeprefix("torch.") for k, v in model.state_dict().items()}
    out = {k: list(rows) for k, rows in kinds.items()}
    for i, k in enumerate(layer_kinds):
        for j, e in enumerate(out[k]):
            dtype = ints.get(e.hf.replace("{i}", str(i)), "float32")
            if not getattr(torch, dtype).is_floating_point and dtype != "bool":
                out[k][j] = replace(e, dtype=dtype)
    return {k: tuple(rows) for k, rows in out.items()}


def _moe(model, layers, where: str) -> Moe | None:
    """Routing facts from the model: which layers route, over how many experts, top-k, and the
    auxiliary loss coefficient when the CausalLM would add it (None when off)."""
    rec = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if rec is None:
        return None
    cls, index = getattr(rec, "target_class", None), getattr(rec, "index", 0)
    routed = [
        i for i, la in enumerate(layers) if cls is not None and any(isinstance(m, cls) for m in la.modules())
    ]
    if not routed:
        return None
    conf = model.config.get_text_config()
    n = _conf_int(conf, ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"))
    top_k = _conf_int(conf, ("num_experts_per_tok", "moe_k", "top_k", "moe_topk", "moe_top_k"))
    if not n or not top_k:
        raise InputError(f"{where}: a routed model without num_experts / num_experts_per_tok in config.json")
    aux = None
    if getattr(conf, "output_router_logits", False) or getattr(model.config, "output_router_logits", False):
        if not switch_loss(model) or not hasattr(model, "router_aux_loss_coef"):
            raise InputError(
                f"{where}: output_router_logits is set, but transformers' {type(model).__name__} adds no "
                "auxiliary loss horizon knows (the Switch load-balancing loss); unset it"
            )
        aux = float(model.router_aux_loss_coef)
    assert cls is not None
    return Moe(cls.__name__, int(index or 0), int(n), int(top_k), tuple(routed), aux)


def _conf_int(conf, keys: tuple[str, ...]) -> int | None:
    """The first positive int of `keys` in the config or its sub-configs (DBRX's ffn_config)."""
    subs = [v for v in vars(conf).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]
    for c in [conf, *subs]:
        for k in keys:
            v = getattr(c, k, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def switch_loss(model) -> bool:
    """The model's module defines transformers' Switch load-balancing loss, op for op as Mixtral's
    (model.moe computes exactly that one)."""
    fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if fn is None:
        return False
    from transformers.models.mixtral import modeling_mixtral

    def key(f):
        c = f.__code__
        return c.co_code, tuple(x for x in c.co_consts if not isinstance(x, str)), c.co_names

    return key(fn) == key(modeling_mixtral.load_balancing_loss_func)
