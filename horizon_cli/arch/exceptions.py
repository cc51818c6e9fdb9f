"""What the generic path refuses, and why: the small table of exceptions (no table of families).

Everything a causal LM of transformers needs is derived from its class (arch.probe, arch.generic);
what cannot run exactly on the streamed engine is refused at convert, before a byte is written,
with one line naming the feature. Most refusals come from what the probe observes (a loop over
the layers, a tensor crossing layers, arithmetic between layers); this module holds those that
cannot be observed on the meta device:

  config keys   whose value turns on something the engine does not do: layer drop (the owner
                skipping whole layers at random), bidirectional attention, custom code, keys and
                values later layers reuse (Gemma 3n / 4's KV sharing). Dropout and router noise
                inside the layers and the embedding train (engine.dropout, model.train_mode)
  model types   that transformers maps as causal LMs but are not decoders the engine can stream
                (encoders used as decoders, permutation or n-gram objectives)
  layers        cross-attention to an encoder in a layer the text forward calls (the decoders of
                BART, Marian, Whisper, ...: their CausalLM classes also take labels unshifted);
                one module's weights used by several layers (Zamba's shared attention block)
"""

from __future__ import annotations

import re

from ..errors import InputError

# any config attribute whose name says dropout, jitter or noise, when positive: trained as
# transformers' modules draw it in train mode (engine.dropout), but layer drop
STOCHASTIC = re.compile(r"drop|jitter|noise")
LAYERDROP = re.compile(r"layer_?drop")
# config keys that turn a decoder into something else; value -> the feature named. Gemma 4's
# `use_bidirectional_attention: "vision"` is bidirectional over image tokens only: causal on text.
FEATURES = {
    "use_bidirectional_attention": "bidirectional attention",
    "is_encoder_decoder": "the decoder of an encoder-decoder model (its cross-attention)",
    "add_cross_attention": "cross-attention to an encoder",
}
# model types whose causal-LM class is not a causal decoder the engine streams
TYPES = {
    "xlnet": "permutation language modelling (not causal)",
    "xlm": "a non-causal masked language model",
    "cpmant": "segment and position biases that make it non-causal",
    "prophetnet": "n-gram prediction streams (a seq2seq decoder)",
    "reformer": "reversible LSH / axial layers that pass two streams between layers",
    "rwkv": "its recurrent state passed from block to block",
    "musicgen": "audio codebooks as inputs",
    "musicgen_melody": "audio codebooks as inputs",
    "git": "image inputs the loss needs",
    "xlstm": "in-place updates in its mLSTM kernels (transformers cannot train it)",
    "blt": "byte patches and several stacks",
}
CROSS = re.compile(r"(^|\.)(encoder_attn|crossattention|cross_attn|cross_attention)$")
ENCODERS = ("bert", "roberta", "electra", "ernie", "xmod", "roformer", "rembert", "data2vec", "big_bird")


def refuse_config(cfg: dict, where: str) -> None:
    """InputError naming the first feature of this config.json the generic path cannot run."""
    mt = str(cfg.get("model_type"))
    arch = (cfg.get("architectures") or [mt])[0]
    if cfg.get("auto_map"):
        raise InputError(
            f"{where}: {arch} is custom code (auto_map): horizon runs transformers' own classes only"
        )
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise InputError(
            f"{where}: quantized checkpoint (quant_method {method!r}): convert needs unquantized weights"
        )
    if mt in TYPES:
        raise InputError(f"{where}: {arch} (model_type {mt!r}): {TYPES[mt]} is not supported")
    if "is_decoder" in cfg and any(e in mt for e in ENCODERS):
        raise InputError(
            f"{where}: {arch} (model_type {mt!r}) is an encoder (bidirectional architecture) used as a "
            "decoder: not supported; horizon trains decoder-only language models"
        )
    for c in _configs(cfg):
        for key, feature in FEATURES.items():
            if c.get(key) and c.get(key) != "vision":
                raise InputError(f"{where}: {key} is set: {feature} is not supported by the generic path")
    for key, v in stochastic_keys(cfg):
        if LAYERDROP.search(key):
            raise InputError(
                f"{where}: {key} = {v}: layer drop (skipping whole layers at random in training) is not "
                "supported (set it to 0)"
            )


def stochastic_keys(cfg: dict) -> list[tuple[str, float]]:
    """The config's (and its language model's) positive dropout / noise settings, by key."""
    out = []
    for c in _configs(cfg):
        for key, v in c.items():
            if STOCHASTIC.search(key) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                out.append((key, float(v)))
    return out


def _configs(cfg: dict) -> list[dict]:
    """The config and its language model's (text_config), where decoder settings live."""
    out = [cfg]
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(cfg.get(key), dict):
            out.append(cfg[key])
    return out


def refuse_layers(layers: list, calls: list[int], cls: str, where: str) -> None:
    """InputError when a layer the text forward calls attends to an encoder's states."""
    for i in calls:
        hit = next((n for n, _ in layers[i].named_modules() if CROSS.search(n)), None)
        if hit is not None:
            raise InputError(
                f"{where}: {cls}'s layers attend to an encoder ({hit}): the decoder of an encoder-decoder "
                "model is not supported; horizon trains decoder-only language models"
            )


def refuse_shared(model, stack: str, where: str) -> None:
    """InputError when several layers hold the same parameter (transformers ties Zamba's shared
    attention block across its hybrid layers): each layer's unit would train a copy of its own."""
    owners: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(n)
    for names in owners.values():
        layers = {n[len(stack) + 1 :].split(".")[0] for n in names if n.startswith(stack + ".")}
        if layers and len(names) > 1:
            raise InputError(
                f"{where}: {' and '.join(names[:2])} are one tensor (weights shared by several layers, "
                "tied by transformers): a block shared across layers is not supported"
            )


def refuse_packing(packing: bool, spec) -> None:
    """InputError when packed rows would meet recurrent layers (Mamba, Gated DeltaNet, short
    convolutions): transformers resets no recurrent state at a document boundary, so one packed
    document would leak into the next (a measured 0.028 logit difference on Qwen3-Next)."""
    g = getattr(spec, "generic", None)
    rec = list(g.recurrent) if g is not None else []
    if packing and rec:
        raise InputError(
            f"data.packing: {spec.family}'s layers carry a recurrent state ({', '.join(rec[:3])}) that "
            "transformers does not reset between packed documents; set data.packing: false"
        )
