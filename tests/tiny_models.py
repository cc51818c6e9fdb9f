"""Tiny random transformers models of every supported family, for oracle tests."""

from __future__ import annotations

from pathlib import Path

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

FAMILIES = {
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


def make_model(
    family: str = "llama", tie: bool = False, seed: int = 0, **over
) -> transformers.PreTrainedModel:
    cfg_cls, model_cls, extra = FAMILIES[family]
    cfg = cfg_cls(**{**BASE, **extra, "tie_word_embeddings": tie, **over})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():  # norms and biases away from their init so every flag is exercised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
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
