"""Census: tiny configs, derived from each config class's defaults by name rules.

A rule matches a config attribute's real name (not an attribute_map alias) and shrinks its value;
nothing is set that the class does not have. FIXUPS holds what the rules cannot derive, per type:
that table is itself a census finding. Sub-configs (text_config, ...) follow the same rules.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn
from transformers import CONFIG_MAPPING, PretrainedConfig

VOCAB = 128


def _cap(n):
    return lambda v: min(v, n) if isinstance(v, int) and not isinstance(v, bool) else v


def _zero(v):
    return 0.0 if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else v


def _unit_off(v):
    return 0.5 if isinstance(v, float) and v == 1.0 else v


# (regex on the attribute name, new value from the old); the first rule that matches applies
RULES = [
    (r"drop|jitter|noise", _zero),  # dropout, layerdrop, router / input jitter: off
    # multipliers that default to 1.0 would hide whether horizon applies them (Granite, MiniCPM, ...)
    (r"(multiplier|^logits_scaling|^logit_scale|^scale_emb|^scale_depth|^routed_scaling_factor)$", _unit_off),
    (r"^encoder_layers$", _cap(2)),
    (r"vocab_size", _cap(VOCAB)),  # vocab_size_per_layer_input too (Gemma 3n / 4 per-layer embeddings)
    (r"^hidden_size_per_layer_input$", _cap(16)),
    (
        r"^(hidden_size|n_embd|n_embed|d_model|emb_dim|embed_dim|embedding_dim|dim|word_embed_proj_dim)$",
        _cap(64),
    ),
    (r"(moe|expert|shared).*(intermediate|ffn|hidden)|(intermediate|ffn).*(moe|expert|shared)", _cap(32)),
    (r"intermediate|ffn|^d_ff$|^dff$|^n_inner$|^d_inner$", _cap(64)),
    (r"key_value_heads|kv_heads|multi_query_group_num|^num_kv$", _cap(2)),
    (r"heads$|^n_head$|attention_heads", _cap(4)),
    (r"rotary_dim|rotary_emb_dim|^rope_dim$", _cap(8)),
    (r"head_dim|d_head$|^d_kv$|kv_channels|head_size", _cap(16)),
    (r"^(n_groups|mamba_n_groups|ssm_n_groups)$", _cap(1)),
    (r"^(num_experts|n_routed_experts|num_local_experts|moe_num_experts|n_experts)$", _cap(4)),
    (r"^(n_shared_experts|num_shared_experts|moe_num_shared_experts)$", _cap(1)),
    (
        r"experts_per_tok|experts_per_token|^moe_topk$|^moe_k$|^top_k$|^topk$|selected_experts|^moe_top_k$",
        _cap(2),
    ),
    (r"^(n_group|num_expert_group)$", _cap(2)),
    (r"^topk_group$", _cap(1)),
    (r"^first_k_dense_replace$", _cap(1)),
    (r"lora_rank$", _cap(16)),
    (r"d_state$|state_size$", _cap(16)),
    (r"^(sliding_window|sliding_window_size|attention_window_size|attention_chunk_size)$", _cap(8)),
]
LAYERS = re.compile(r"^(num_hidden_layers|n_layer|n_layers|num_layers|decoder_layers|num_blocks)$")
# (SSM heads, SSM head dim, expand): heads * head_dim must equal expand * hidden_size
SSM = [("mamba_n_heads", "mamba_d_head", "mamba_expand"), ("mamba_num_heads", "mamba_head_dim", "expand")]
TOKEN_ID = re.compile(r"(token_id|token_index|_token)$")
TEXT_SUBS = ("text_config", "decoder", "language_config", "llm_config", "decoder_config", "global_config")


def _lfm2_moe(n: int) -> dict:  # layer_types defaults to None and the model indexes it
    return {
        "layer_types": ["conv" if i % 2 == 0 else "full_attention" for i in range(n)],
        "num_dense_layers": 1,
    }


def _alternate(n: int) -> dict:  # Mamba and attention layers, alternating
    return {"layer_types": (["linear_attention", "full_attention"] * n)[:n]}


def _conv_attention(n: int) -> dict:
    return {"layer_types": (["conv", "full_attention"] * n)[:n]}


GEMMA4_NO_PLE = dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
QSA = dict(
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4
)

# What the rules cannot derive. model_type -> overrides on the config (a dict, or a function of the
# layer count), on a sub-config as {"sub:<name>": {...}}, or "use_sub": the sub-config the
# ForCausalLM class really takes. Found by running the census; each line says why. Most are
# defaults of the config class that do not build a model at any size (transformers' own gap).
FIXUPS: dict[str, dict | Callable[[int], dict]] = {
    # the model reads rope_parameters[layer_type]; the default config has none
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    },
    # DbrxAttention reads attn_config.rope_theta; clip_qkv None reaches torch.clamp(min=None, max=None)
    "dbrx": {"sub:attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "deepseek_v2": {"num_experts_per_tok": 2},  # defaults to None: the router's topk needs it
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},  # all default to None
    "dots3_note_text": {"num_key_value_heads": 4},  # its validator: kv heads == heads
    "dots3_note": {
        "sub:text_config": {"num_key_value_heads": 4},
        "sub:vision_config": {"adapter_in_dim": 64, "adapter_out_dim": 64},
        "sub:audio_config": {"adapter_input_size": 64, "adapter_out_dim": 64},
    },  # adapters sized to the tiny hidden
    "hunyuan_v1_dense": {"head_dim": 16},  # head_dim defaults to None and the attention needs it
    "hunyuan_v1_moe": {"head_dim": 16},
    "ministral": {"head_dim": 16},
    "nemotron": {"num_key_value_heads": 2},  # defaults to None; the attention divides by it
    "lfm2_moe": _lfm2_moe,
    "qwen4_exp_text": QSA,  # the QSA indexer's sizes default to None
    "qwen4_exp": {"sub:text_config": QSA},
    "gemma3n_text": {"num_kv_shared_layers": 2},
    # the full-attention layers' head size is an init argument (not an attribute the shrinking
    # sees): 512-wide heads with Gemma 4's unscaled q.k would make the tiny model chaotic in fp32
    "gemma4_text": {"global_head_dim": 16},
    "gemma4": {"sub:text_config": {"global_head_dim": 16}},
    "gemma4_unified_text": {"global_head_dim": 16},
    "gemma4_unified": {
        "sub:text_config": {"global_head_dim": 16}
    },  # 15 KV-sharing layers do not fit a shallow model
    # its validator refuses its own default text config; "init": what the default is built with
    "gemma4_assistant": {
        "init": {"text_config": {"model_type": "gemma4_text", **GEMMA4_NO_PLE}},
        "sub:text_config": GEMMA4_NO_PLE,
    },
    "mamba2": {"num_heads": 8},  # num_heads * head_dim must be expand * hidden_size
    # all-Mamba by default, and then transformers cannot build the masks (no attention layer)
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": _alternate,
    "lfm2": _conv_attention,  # all attention by default: the short convolutions would go untested
    # transformers fails when the window is shorter than the sequence (modeling_dory.py:263-266);
    # the default sections (8 input, 8 output layers) capped at 4 layers leave -12 recurrent ones,
    # which runs every layer twice with no loop between: one layer of each section and a real loop
    "dory": {"sliding_window": 32, "n_input_layers": 1, "n_recurrent_layers": 2, "n_output_layers": 1},
    "reformer": {
        "axial_pos_shape": [4, 6],
        "axial_pos_embds_dim": [32, 32],
    },  # product = seq len, sum = hidden
    # q/k widths are rounded up to a multiple of 64: at hidden 64, qk_dim_factor 0.5 the heads
    # disagree (modeling_xlstm.py:412); chunk_size must divide the sequence
    "xlstm": {"hidden_size": 128, "embedding_dim": 128, "chunk_size": 8},
    # the loop spans layers 6-18 of 24 by default; the cache indexes past a shallower stack
    "inkling2_loop_text": {
        "loop_layer_index_start": 2,
        "loop_layer_index_end": 4,
        "n_layers_per_attn_res_block": 2,
    },
    "xmod": {"default_language": "en_XX"},  # its forward needs a language for the adapters
    "musicgen": {"use_sub": "decoder"},  # MusicgenForCausalLM takes the decoder's config
    "musicgen_melody": {"use_sub": "decoder"},
}


def attrs(cfg: PretrainedConfig) -> dict:
    return {k: v for k, v in vars(cfg).items() if not k.startswith("_")}


def shrink_kwargs(default: PretrainedConfig, n_layers: int | None) -> dict:
    """The attributes to pass to the class to get its tiny version."""
    kw = {}
    cls = type(default)
    for name, value in attrs(default).items():
        if isinstance(value, PretrainedConfig) or value is None:
            continue
        if getattr(cls, name, "") is None:  # derived in __post_init__ from others: let it re-derive
            continue
        if LAYERS.match(name):
            if n_layers is not None and isinstance(value, int):
                kw[name] = n_layers
            continue
        for pat, fn in RULES:
            if re.search(pat, name):
                new = fn(value)
                if new != value:
                    kw[name] = new
                break
    if getattr(default, "is_decoder", None) is False:  # BERT-like: the causal LM needs it
        kw["is_decoder"] = True
    heads, kv, d = kw.get("num_attention_heads"), "num_key_value_heads", attrs(default)
    if heads and d.get(kv) == d.get("num_attention_heads"):
        kw[kv] = heads  # no GQA in the full model (MLA, MHA): none in the tiny one either
    hidden = kw.get("hidden_size", d.get("hidden_size"))
    for h, hd, e in SSM:
        if all(a in d for a in (h, hd, e)) and hidden:
            kw[h] = max(1, d[e] * hidden // kw.get(hd, d[hd]))
    return kw


def token_ids(cfg_kw: dict, default: PretrainedConfig, vocab: int) -> dict:
    """Special-token ids that would fall outside the tiny vocabulary: the top ids instead."""
    out, free = {}, vocab - 1
    for name, value in attrs(default).items():
        if not TOKEN_ID.search(name) or name in cfg_kw:
            continue
        vals = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals) or not vals:
            continue
        new = []
        for v in vals:
            if v >= vocab or v < 0:
                new.append(free)
                free -= 1
            else:
                new.append(v)
        if new != vals:
            out[name] = new if isinstance(value, list) else new[0]
    return out


def n_layers_of(cfg: PretrainedConfig) -> int | None:
    for name, value in attrs(cfg).items():
        if LAYERS.match(name) and isinstance(value, int):
            return value
    for name in ("layer_types", "layers_block_type"):  # Nemotron-H: the list is the depth
        if isinstance(getattr(cfg, name, None), list):
            return len(getattr(cfg, name))
    return None


def per_layer_lists(default: PretrainedConfig) -> dict[str, list]:
    n = n_layers_of(default)
    return {
        k: list(v)
        for k, v in attrs(default).items()
        if isinstance(v, (list, tuple)) and n and n > 1 and len(v) == n and not _indices(v)
    }


def build_sub(cls, n_layers: int | None, extra: dict, vocab: int | None = None) -> PretrainedConfig:
    """cls's defaults, shrunk; per-layer lists truncated when the class does not derive them."""
    extra = dict(extra)
    default = cls(**extra.pop("init", {}))
    kw = shrink_kwargs(default, n_layers)
    for name, sub in attrs(default).items():
        if isinstance(sub, PretrainedConfig):
            kw[name] = build_sub(
                type(sub), n_layers if name in TEXT_SUBS else 2, extra.get(f"sub:{name}", {})
            )
    text_vocab = vocab
    if text_vocab is None:
        t = kw.get("text_config") if isinstance(kw.get("text_config"), PretrainedConfig) else None
        text_vocab = (
            getattr(t, "vocab_size", None) or kw.get("vocab_size") or getattr(default, "vocab_size", VOCAB)
        )
    kw.update(token_ids(kw, default, min(text_vocab, VOCAB) if isinstance(text_vocab, int) else VOCAB))
    kw.update({k: v for k, v in extra.items() if not k.startswith("sub:")})
    lists = per_layer_lists(default)
    n = kw.get(next((k for k in kw if LAYERS.match(k)), ""), None)
    try:
        cfg = _make(cls, kw)
    except Exception:  # noqa: BLE001 (a per-layer list of the default depth: truncate it)
        if not (lists and n):
            raise
        return _make(cls, {**kw, **{k: v[:n] for k, v in lists.items()}})
    stale = {k: v[:n] for k, v in lists.items() if n and len(getattr(cfg, k, []) or []) != n}
    if stale:
        cfg = _make(cls, {**kw, **stale})
    return cfg


def _make(cls, kw: dict) -> PretrainedConfig:
    cfg = cls(**kw)
    cfg.dtype = torch.float32
    return cfg


def tiny_config(mt: str, n_layers: int | None) -> PretrainedConfig:
    """n_layers None: the class's default depth (every other size shrunk)."""
    fix = FIXUPS.get(mt, {})
    if callable(fix):
        fix = fix(n_layers or n_layers_of(CONFIG_MAPPING[mt]()) or 2)
    fix = dict(fix)
    use = fix.pop("use_sub", None)
    if use:
        sub = getattr(CONFIG_MAPPING[mt](), use)
        return build_sub(type(sub), n_layers, fix)
    return build_sub(CONFIG_MAPPING[mt], n_layers, fix)


def build(mt: str, cfg: PretrainedConfig, device="cpu") -> nn.Module:
    """The mapping's own ForCausalLM class on cfg (what AutoModelForCausalLM.from_config does)."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with torch.device(device):
        if "use_sub" not in (fix if isinstance(fix := FIXUPS.get(mt), dict) else {}):
            return AutoModelForCausalLM.from_config(cfg)
        return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt])._from_config(cfg)


def text_config(cfg: PretrainedConfig) -> PretrainedConfig:
    try:
        return cfg.get_text_config()
    except Exception:  # noqa: BLE001 (a config without one: itself)
        return cfg


# ---------------------------------------------------------------------------------------------
# layer kinds: how few layers hold every kind of layer the full-depth config has

AVOID = ("vision", "visual", "audio", "encoder", "vq", "patch", "image", "depth", "mtp", "speech", "sound")


def layer_stack(model: nn.Module, n: int) -> tuple[str | None, nn.ModuleList | None]:
    """The ModuleList of n decoder layers: prefer *Layer/*Block/*Decoder children, then paths
    away from vision/audio towers, then the shallowest."""
    cands = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]

    def score(item):
        p, m = item
        cls = type(m[0]).__name__
        layerish = any(s in cls for s in ("Layer", "Block", "Decoder", "Mixer"))
        return (not layerish, any(w in p.lower() for w in AVOID), p.count("."), p)

    return min(cands, key=score) if cands else (None, None)


def layer_signature(layer: nn.Module, lists: dict[str, list], i: int) -> str:
    parts = []
    for name, m in layer.named_modules():
        flags = sorted(
            f"{k}={v}"
            for k, v in vars(m).items()
            if not k.startswith("_") and k != "training" and isinstance(v, (bool, str))
        )
        if hasattr(m, "sliding_window"):
            flags.append(f"window={bool(m.sliding_window)}")
        parts.append(f"{name}:{type(m).__name__}[{','.join(flags)}]")
    parts += [f"cfg.{k}={v[i]}" for k, v in sorted(lists.items()) if i < len(v)]
    return ";".join(parts)


def _indices(v) -> bool:
    """A list of layer indices (moe_layers = [0, 1, ...]), not a per-layer value."""
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    return ints and len(v) > 2 and all(a < b for a, b in zip(v, v[1:], strict=False))


def kinds(mt: str, cfg: PretrainedConfig, device="meta") -> tuple[str | None, list[str]]:
    """(stack path, one signature per layer) of the model cfg builds."""
    model = build(mt, cfg, device)
    t = text_config(cfg)
    n = n_layers_of(t)
    path, stack = layer_stack(model, n) if n else (None, None)
    if stack is None:
        return None, []
    lists: dict = {
        k: v for k, v in attrs(t).items() if isinstance(v, (list, tuple)) and len(v) == n and not _indices(v)
    }
    return path, [layer_signature(layer, lists, i) for i, layer in enumerate(stack)]


def choose_depth(mt: str, max_layers: int = 16) -> dict:
    """The fewest layers (>= 2) whose model has every layer kind of the full-depth one."""
    full_cfg = tiny_config(mt, None)
    full_n = n_layers_of(text_config(full_cfg))
    info: dict = {"default_layers": full_n}
    try:
        path, sigs = kinds(mt, full_cfg)
    except Exception as e:  # noqa: BLE001 (meta build failed: try on the CPU, still tiny)
        info["meta_error"] = f"{type(e).__name__}: {e}"[:300]
        path, sigs = kinds(mt, full_cfg, device="cpu")
    want = sorted(set(sigs))
    info.update(stack=path, kinds=len(want))
    if not want or not full_n or full_n < 3:
        info.update(layers=min(full_n or 2, 2), covered=bool(want))
        return info
    best, failed = None, {}
    for n in range(2, min(full_n, max_layers) + 1):
        try:
            _, got = kinds(mt, tiny_config(mt, n))
        except Exception as e:  # noqa: BLE001 (too shallow for the class: e.g. one shared block)
            failed[n] = f"{type(e).__name__}: {e}"[:200]
            continue
        have = len(set(got) & set(want))
        if best is None or have > best[1] or (have == best[1] and len(set(got)) > len(set(best[2]))):
            best = (n, have, got)
        if have == len(want):
            break
        if len(set(got)) >= len(want) and have < len(want):  # as many kinds, named differently
            best = (n, len(want), got)
            info["covered_by_count"] = True
            break
    if failed:
        info["too_shallow"] = failed
    if best is None:
        raise ValueError(f"no depth in 2..{max_layers} builds: {failed}")
    n, have, got = best
    info.update(
        layers=n, covered=have == len(want), layer_kinds=[want.index(s) if s in want else -1 for s in got]
    )
    if have < len(want):
        info["kinds_missing"] = len(want) - have
    return info
