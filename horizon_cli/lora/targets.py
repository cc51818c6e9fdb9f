"""Which linear layers get LoRA adapters: PEFT's `target_modules` rules over the model's module names.

PEFT matches a *list* of names against every module name of the model: a name equal to an entry,
or ending in "." + an entry (a suffix match: `q_proj` matches `model.layers.3.self_attn.q_proj`);
a *string* is a regular expression that must match the whole module name (`re.fullmatch`), except
"all-linear" (any case), every linear layer but the output layer. A matched module must be a
linear layer (PEFT raises on anything else, and so does horizon); horizon adds adapters inside
the decoder layers only, so a match on the embedding or the LM head is refused, and so is a list
that matches nothing.

Module names come from the native families' fixed tree (transformers' Llama / Mistral / Qwen2 /
Qwen3 modules) or, on the generic path, from transformers' own model built on the meta device.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..arch import ArchSpec
from ..arch.names import layer_tensors
from ..errors import InputError

ALL_LINEAR = "all-linear"
KIND = {"embedding": "input embedding", "lm_head": "LM head"}


@dataclass(frozen=True)
class Target:
    """One adapted linear layer of decoder layer `layer`."""

    layer: int
    module: str  # full module name, e.g. "model.layers.3.self_attn.q_proj" (PEFT's key)
    rel: str  # relative to the decoder layer, e.g. "self_attn.q_proj"
    weight: (
        str  # the engine's name of its weight in the layer unit ("wq"; generic: "self_attn.q_proj.weight")
    )
    in_features: int
    out_features: int


@dataclass(frozen=True)
class Module:
    name: str
    kind: str  # "linear" (inside a decoder layer) | "embedding" | "lm_head" | a class name


def native_modules(spec: ArchSpec) -> tuple[list[Module], dict[str, Target]]:
    """transformers' module tree of a native family, and the linear layers of its decoder layers."""
    mods = [Module(n, "container") for n in ("", "model", "model.layers")]
    mods += [Module("model.embed_tokens", "embedding"), Module("model.norm", "RMSNorm")]
    mods += [Module("model.rotary_emb", "RotaryEmbedding"), Module("lm_head", "lm_head")]
    linear: dict[str, Target] = {}
    for i in range(spec.n_layers):
        p = f"model.layers.{i}"
        mods += [Module(p, "DecoderLayer"), Module(p + ".self_attn", "Attention"), Module(p + ".mlp", "MLP")]
        mods += [Module(p + ".mlp.act_fn", "Activation")]
        for t in layer_tensors(spec, i):
            if t.hf.endswith(".bias"):  # the same module as its weight
                continue
            module = t.hf.rsplit(".", 1)[0]
            is_linear = t.hf.endswith(".weight") and len(t.shape) == 2
            mods.append(Module(module, "linear" if is_linear else "RMSNorm"))
            if is_linear:
                rel = module[len(p) + 1 :]
                linear[module] = Target(i, module, rel, t.name, t.shape[1], t.shape[0])
    return mods, linear


TOWER = "tower"  # a module of a multimodal model's vision tower or projector (never a decoder's)


def generic_modules(spec: ArchSpec) -> tuple[list[Module], dict[str, Target]]:
    """The same read off transformers' model on the meta device (arch.generic)."""
    import torch

    from ..arch.generic import stored_model

    g = spec.generic
    assert g is not None
    model = stored_model(g)
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    prefix = g.prefix  # "model.layers."
    carried = set(g.carried)  # a multimodal model's tower and projector (checkpoint names)
    mods, linear = [], {}
    for name, m in model.named_modules():
        parts = name.split(".")
        if m is emb:
            kind = "embedding"
        elif m is out:
            kind = "lm_head"
        elif isinstance(m, torch.nn.Linear) and name.startswith(prefix):
            kind = "linear"
            i_str, rel = name[len(prefix) :].split(".", 1)
            linear[name] = Target(int(i_str), name, rel, rel + ".weight", m.in_features, m.out_features)
        elif carried and any(".".join(parts[i:]) + ".weight" in carried for i in range(len(parts))):
            kind = TOWER
        else:
            kind = type(m).__name__
        mods.append(Module(name, kind))
    return mods, linear


def matches(targets: list[str] | str, name: str) -> bool:
    """PEFT's check_target_module_exists for target_modules (no exclude/layers_to_transform)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return name in targets or any(name.endswith("." + t) for t in targets)


def resolve_targets(
    targets: list[str] | str, spec: ArchSpec, where: str = "lora.targets"
) -> list[list[Target]]:
    """Per decoder layer, the adapted linear layers in module order; InputError naming the module
    when a target matches something that is not a decoder layer's linear layer, or nothing."""
    mods, linear = spec.pick(native_modules, generic_modules)(spec)
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        chosen = [m for m in mods if m.kind == "linear"]
    else:  # a tower's modules of the same names left out, as LLaMA-Factory's freeze_vision_tower does
        chosen = [m for m in mods if m.name and m.kind != TOWER and matches(targets, m.name)]
    for m in chosen:
        if m.kind in ("embedding", "lm_head"):
            raise InputError(
                f"{where}: {targets!r} matches {m.name} (the {KIND[m.kind]}): horizon adapts "
                "the linear layers of the decoder layers only"
            )
        if m.kind != "linear":
            raise InputError(
                f"{where}: {targets!r} matches {m.name} ({m.kind}), not a linear layer (PEFT refuses it too)"
            )
    if not chosen:
        raise InputError(f"{where}: {targets!r} matches no module of the model (e.g. q_proj, v_proj)")
    out: list[list[Target]] = [[] for _ in range(spec.n_layers)]
    for m in chosen:
        t = linear[m.name]
        out[t.layer].append(t)
    return out


# peft (with transformers 5) converts the target_modules of a model whose experts transformers
# fused: the names of the v4 expert projections become the fused experts' target_parameters and
# leave target_modules, so a dense linear layer of the same name (DeepSeek-V3's first dense layers,
# shared experts) gets no adapter when peft loads the adapter. Keyed by transformers' conversion
# pattern (peft adds mixtral's own).
PEFT_EXPERT_NAMES = {
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj", "gate"),
    "mixtral": ("w1", "w2", "w3", "gate"),
}


def peft_dropped(spec: ArchSpec, targets: list[list[Target]]) -> list[Target]:
    """The adapted layers peft would leave out when it loads this model's adapter (see above)."""
    try:
        from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN as patterns
    except ImportError:  # a transformers without the v5 conversion: peft converts nothing
        return []
    pattern = "mixtral" if spec.family == "mixtral" else patterns.get(spec.family, "")
    names = PEFT_EXPERT_NAMES.get(pattern, ())
    return [t for layer in targets for t in layer if t.rel.rsplit(".", 1)[-1] in names]


def peft_note(spec: ArchSpec, targets: list[list[Target]]) -> str:
    """A warning for peft_dropped, or ""."""
    lost = peft_dropped(spec, targets)
    if not lost:
        return ""
    names = sorted({t.rel.rsplit(".", 1)[-1] for t in lost})
    return (
        f"peft reads {', '.join(names)} in a {spec.family} adapter as its fused experts, so "
        f"PeftModel.from_pretrained leaves out {len(lost)} of this run's adapted layers (e.g. {lost[0].module}) "
        f"and does not give the merged export's logits; output.dir/export has them all. For an "
        f"adapter peft loads whole, leave {', '.join(names)} out of lora.targets"
    )


def scale(alpha: float, r: int, rslora: bool) -> float:
    """PEFT's `scaling`: alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA."""
    return alpha / math.sqrt(r) if rslora else alpha / r


def adapter_params(targets: list[list[Target]], r: int) -> int:
    return sum(r * (t.in_features + t.out_features) for layer in targets for t in layer)
