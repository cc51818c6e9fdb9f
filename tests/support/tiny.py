"""Tiny random transformers models of every supported family, for oracle tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

FAMILIES: dict[str, tuple[Any, Any, dict]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama31": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        ),
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=8)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=16)),
}


# Generic-path families (transformers' own layers): each exercises its family's pieces with tiny
# dims — sliding windows shorter than the test sequences, soft-capping, shared experts, dense then
# MoE layers, multi-head latent attention, attention sinks, expert biases.
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.02)
SMALL = dict(BASE, num_hidden_layers=2, **IDS)
GENERIC: dict[str, tuple[Any, dict]] = {
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            head_dim=8,
            sliding_window=6,
            query_pre_attn_scalar=12,
            final_logit_softcapping=3.0,
            attn_logit_softcapping=5.0,
        ),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            head_dim=8,
            sliding_window=6,
            query_pre_attn_scalar=12,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
        ),
    ),
    "phi3": (transformers.Phi3Config, dict()),
    "olmo2": (transformers.Olmo2Config, dict()),
    "mixtral": (transformers.MixtralConfig, dict(MOE, num_local_experts=4, intermediate_size=24)),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        dict(
            MOE,
            num_experts=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(MOE, num_experts=4, moe_intermediate_size=16, head_dim=8),
    ),
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(
            MOE,
            num_local_experts=4,
            intermediate_size=16,
            head_dim=8,
            sliding_window=6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            moe_intermediate_size=16,
            n_shared_experts=1,
            q_lora_rank=16,
            kv_lora_rank=12,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            routed_scaling_factor=2.5,
        ),
    ),
}


def make_model(
    family: str = "llama", tie: bool = False, seed: int = 0, **over
) -> transformers.PreTrainedModel:
    if family in GENERIC:
        cfg_cls, extra = GENERIC[family]
        cfg = cfg_cls(**{**SMALL, **extra, "tie_word_embeddings": tie, **over})
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg)  # the family's own attention choice
    else:
        cfg_cls, model_cls, extra = FAMILIES[family]
        cfg = cfg_cls(**{**BASE, **extra, "tie_word_embeddings": tie, **over})
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        model = model_cls(cfg)
    model = model.float().eval()
    with torch.no_grad():  # norms, biases, sinks away from their init so every flag is exercised
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("norm.weight", ".bias", "sinks", "_bias")) and p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save(model, path: Path, kind: str = "safetensors") -> Path:
    """kind: safetensors (single file) | sharded (safetensors + index) | bin."""
    path = Path(path)
    if kind == "bin":  # transformers 5 no longer writes .bin: do it as older versions did
        path.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(path)
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        torch.save(sd, path / "pytorch_model.bin")
    elif kind == "sharded":
        model.save_pretrained(path, max_shard_size="20KB")
    else:
        model.save_pretrained(path, max_shard_size="10GB")
    return path
