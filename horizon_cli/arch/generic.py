"""The generic path's architecture description, read off transformers' own model on the meta device.

For a decoder-only causal LM without a native functional layer, `generic_spec` builds the
transformers model from config.json on the meta device (no memory, no weights) and records, as
plain data that goes into the store's manifest:

  units   the tensor table of `embed`, each decoder layer and `head`: every in-memory parameter
          (and persistent buffer, e.g. DeepSeek-V3's `e_score_correction_bias`, kept frozen) with
          its shape, and the checkpoint tensors that fill it (arch.disk). Layers with the same
          table share a *kind* (dense and MoE layers of DeepSeek-V3 are two kinds).
  model   the model-level pieces around the layers (arch.families): masks and rotary embeddings
          per layer type, embedding scale, final logit soft-capping, attention implementation
  moe     experts, top-k, which layers route, and the auxiliary loss coefficient when on

Anything the path cannot do is refused here, before convert writes a byte, with one line naming
the missing piece. Loading a store later reads this data back and never re-derives it.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from .disk import place
from .families import GENERIC, STOCHASTIC, TEXT_OF, Family


def supported_names() -> str:
    """For messages: every family horizon runs, native first."""
    generic = [f"{f.name} ({mt})" for mt, f in GENERIC.items() if mt not in ("llama", "mistral")]
    return "Llama, Mistral, Qwen2, Qwen3 (native); " + ", ".join(generic) + " (generic)"


def hf_config(d: dict, attn: str | None = None):
    """A transformers config object from a config.json dict."""
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[d["model_type"]].from_dict(dict(d))
    if attn is not None:
        cfg._attn_implementation = attn
    return cfg


def meta_model(cfg_dict: dict, attn: str | None = None):
    """The CausalLM on the meta device: names, shapes and module structure, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = hf_config(cfg_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model.eval()


def attn_implementation(cfg_dict: dict) -> str:
    """SDPA where the family supports it, else eager (Gemma 2's soft-capping, gpt-oss's sinks)."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping[type(hf_config(cfg_dict))]
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def check_family(cfg: dict, where: str) -> Family:
    """The family's model-level data, or InputError naming why the generic path cannot run it."""
    mt = cfg.get("model_type")
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = (cfg.get("architectures") or [mt])[0]
    if mt in TEXT_OF:
        raise InputError(
            f"{where}: {arch} is a multimodal wrapper (model_type {mt!r}); horizon trains its decoder-only "
            f"text model: convert a {TEXT_OF[mt]!r} checkpoint"
        )
    media = multimodal(cfg) if mt not in GENERIC else None
    if media is not None:  # until the language model of a wrapper converts (issue 19)
        text = (cfg.get("text_config") or {}).get("model_type")
        inner = f" (its language model: {text!r})" if text else ""
        raise InputError(
            f"{where}: {arch} (model_type {mt!r}) is a multimodal ({media}) checkpoint{inner}: horizon "
            f"trains decoder-only language models; {MEDIA_INPUTS[media]} inputs and this multimodal "
            "wrapper are not supported yet"
        )
    if mt not in CONFIG_MAPPING or mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise InputError(
            f"{where}: unsupported architecture {arch!r} (model_type {mt!r}): not a causal LM in transformers; "
            f"supported: {supported_names()}"
        )
    if mt not in GENERIC:
        raise InputError(
            f"{where}: unsupported architecture {arch!r} (model_type {mt!r}): a causal LM in transformers, "
            "but its model-level pieces (masks, rotary, embedding, head) are not described for the generic "
            f"path (horizon_cli/arch/families.py); supported: {supported_names()}"
        )
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise InputError(
            f"{where}: quantized checkpoint (quant_method {method!r}): convert needs unquantized weights"
        )
    fam = GENERIC[mt]
    for key, piece in fam.refuse.items():
        if cfg.get(key):
            raise InputError(f"{where}: {key} is set: {piece} is not supported by the generic path")
    for key in STOCHASTIC:
        if cfg.get(key):
            raise InputError(
                f"{where}: {key} = {cfg[key]}: dropout and router noise are not supported (set it to 0)"
            )
    return fam


MEDIA_INPUTS = {
    "vision-language": "image",
    "audio-language": "audio",
    "vision-audio-language": "image and audio",
}


def multimodal(cfg: dict) -> str | None:
    """'vision-language' (LLaVA, Qwen2-VL, ...), 'audio-language' or 'vision-audio-language' for
    a checkpoint that wraps a language model with another modality's tower, else None. Read off
    the config's sub-configs, and transformers' image-text-to-text mapping for the model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    vision = "vision_config" in cfg or cfg.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    audio = "audio_config" in cfg
    if vision and audio:
        return "vision-audio-language"
    return "vision-language" if vision else "audio-language" if audio else None


def generic_spec(cfg: dict, where: str, disk: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """The `generic` block of an ArchSpec (see module doc). `disk`: the checkpoint's tensor names
    and shapes (None: a config-only description, assuming the in-memory layout)."""
    fam = check_family(cfg, where)
    attn = attn_implementation(cfg)
    model = meta_model(cfg, attn)
    conf = model.config
    base = getattr(model, model.base_model_prefix)
    layers = getattr(base, "layers", None)
    if layers is None or getattr(base, "norm", None) is None:
        raise InputError(
            f"{where}: {type(base).__name__} has no `layers` and `norm`: not a decoder stack the generic path knows"
        )
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    if getattr(out, "bias", None) is not None:
        raise InputError(f"{where}: the LM head has a bias, which the generic path does not support")
    scale = _embed_scale(emb, where)
    tied = bool(conf.get_text_config().tie_word_embeddings)
    names = _module_names(model)
    mem = _memory_tensors(model, tied, names["lm_head"])
    parts = place(model, mem, disk, where, frozenset({names["lm_head"]}) if tied else frozenset())
    prefix = names["layers"] + "."
    units = {"embed": [_entry("embed", names["embed"], mem, parts, True)]}
    head = [
        _entry("norm." + n, f"{names['norm']}.{n}", mem, parts, True) for n, _ in base.norm.named_parameters()
    ]
    if not tied:
        head.append(_entry("lm_head", names["lm_head"], mem, parts, True))
    units["head"] = head
    kinds, layer_kinds = _layer_kinds(layers, prefix, mem, parts)
    covered = {e["hf"] for u in units.values() for e in u} | {
        e["hf"].replace("{i}", str(i)) for i, k in enumerate(layer_kinds) for e in kinds[k]
    }
    stray = [k for k in mem if k not in covered]
    if stray:
        raise InputError(
            f"{where}: model-level tensor {stray[0]} lies outside the decoder layers: not supported"
        )
    L = conf.num_hidden_layers
    return {
        "config": cfg,
        "attn": attn,
        "family": fam.name,
        "layer_class": type(layers[0]).__name__,
        "masks": fam.masks,
        "rope": fam.rope if hasattr(base, "rotary_emb") else "none",
        "softcap": getattr(conf, fam.softcap, None) if fam.softcap else None,
        "embed_scale": scale,
        "layer_types": list(getattr(conf, "layer_types", None) or ["full_attention"] * L),
        "sliding_window": getattr(conf, "sliding_window", None),
        "prefix": prefix,
        "units": units,
        "kinds": kinds,
        "layer_kinds": layer_kinds,
        "moe": _moe(model, layers, fam, where),
    }


def _embed_scale(emb, where: str) -> float | None:
    import torch

    if hasattr(emb, "scalar_embed_scale"):  # Gemma's scaled word embedding: x * sqrt(hidden)
        return float(emb.scalar_embed_scale)
    if type(emb) is not torch.nn.Embedding:
        raise InputError(
            f"{where}: input embedding {type(emb).__name__} is neither plain nor scaled: not supported"
        )
    return None


def _module_names(model) -> dict[str, str]:
    """Full names of the pieces the engine handles itself."""
    every = list(model.named_parameters(remove_duplicate=False))  # a tied head appears under both names
    base_name = model.base_model_prefix
    return {
        "embed": next(n for n, p in every if p is model.get_input_embeddings().weight),
        "lm_head": [n for n, p in every if p is model.get_output_embeddings().weight][-1],
        "norm": f"{base_name}.norm",
        "layers": f"{base_name}.layers",
    }


def _memory_tensors(model, tied: bool, lm_head: str) -> dict[str, tuple[int, ...]]:
    """Every parameter and persistent buffer in memory (the tied LM head once, as the embedding)."""
    out = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if tied:
        out.pop(lm_head, None)
    return out


def _entry(name: str, hf: str, mem: dict, parts: dict, trainable: bool, layer: int | None = None) -> dict:
    """One parameter of a unit's table: its name for the engine, in-memory name, shape, and the
    disk tensors that fill it. In a layer kind, `{i}` stands for the layer index."""

    def tmpl(s: str) -> str:
        return s if layer is None else _templ(s, layer)

    return {
        "name": name,
        "hf": tmpl(hf),
        "shape": list(mem[hf]),
        "trainable": trainable,
        "parts": [{"hf": tmpl(p.hf), "shape": list(p.shape), "at": p.at} for p in parts[hf]],
    }


def _templ(name: str, i: int) -> str:
    """Replace the layer index in a tensor name with `{i}`."""
    key = f"layers.{i}."
    at = name.find(key)
    if at < 0:
        raise InputError(f"tensor {name}: cannot find its layer index {i}")
    return name[:at] + "layers.{i}." + name[at + len(key) :]


def _layer_kinds(layers, prefix: str, mem: dict, parts: dict) -> tuple[dict[str, list], list[str]]:
    """Per-layer tables, deduplicated into kinds (kind names: 'k0', 'k1', ... in order of first use)."""
    kinds: dict[str, list] = {}
    keys: dict[str, str] = {}
    layer_kinds = []
    for i, layer in enumerate(layers):
        params = {n for n, _ in layer.named_parameters()}
        rows = [
            _entry(n, f"{prefix}{i}.{n}", mem, parts, n in params, layer=i)
            for n in [*params_in_order(layer), *[b for b in layer.state_dict() if b not in params]]
        ]
        rows.sort(key=lambda r: not r["trainable"])  # frozen tensors last: the optimizer stops before them
        key = repr(rows)
        if key not in keys:
            keys[key] = f"k{len(kinds)}"
            kinds[keys[key]] = rows
        layer_kinds.append(keys[key])
    return kinds, layer_kinds


def params_in_order(module) -> list[str]:
    return [n for n, _ in module.named_parameters()]


def _moe(model, layers, fam: Family, where: str) -> dict | None:
    """Routing facts from the model: which layers route, over how many experts, top-k, and the
    auxiliary loss coefficient when the ForCausalLM would add it (None when off)."""
    rec = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if rec is None:
        return None
    cls, index = getattr(rec, "target_class", None), getattr(rec, "index", 0)
    routed = [
        i
        for i, layer in enumerate(layers)
        if cls is not None and any(isinstance(m, cls) for m in layer.modules())
    ]
    if not routed:
        return None
    conf = model.config
    n = next(
        (
            getattr(conf, k)
            for k in ("num_local_experts", "num_experts", "n_routed_experts")
            if getattr(conf, k, None)
        ),
        None,
    )
    top_k = getattr(conf, "num_experts_per_tok", None)
    if not n or not top_k:
        raise InputError(f"{where}: a routed model without num_experts / num_experts_per_tok in config.json")
    aux = None
    if getattr(conf, "output_router_logits", False):
        if fam.aux != "switch":
            raise InputError(
                f"{where}: output_router_logits is set, but transformers' {type(model).__name__} adds no "
                "auxiliary loss horizon knows; unset it"
            )
        aux = float(model.router_aux_loss_coef)
    assert cls is not None  # routed layers were found by it
    return {
        "router": cls.__name__,
        "logits_index": int(index or 0),
        "n_experts": int(n),
        "top_k": int(top_k),
        "layers": routed,
        "aux_coef": aux,
    }
