"""Model-level pieces of each generic family, as data (no copies of transformers' model code).

The generic path runs transformers' own decoder-layer modules. What happens *around* the layers
differs per family and lives in each family's `XxxModel.forward` / `XxxForCausalLM.forward`; this
table says, for every family the generic path has been checked on (tests/test_generic_*.py), which
variant of each piece that code uses:

  masks   which attention mask each layer gets: "causal" (every layer full causal), "window"
          (every layer sliding when config.sliding_window is set, else causal: Mistral-style),
          "layer_types" (per layer from config.layer_types: full / sliding)
  rope    "shared" (one rotary_emb(x, position_ids) for all layers) or "per_layer_type"
          (rotary_emb(x, position_ids, layer_type): Gemma 3's local/global bases)
  softcap config key of the final logit soft-capping (logits = tanh(logits / c) * c), or None
  aux     "switch": the ForCausalLM adds router_aux_loss_coef * load_balancing_loss_func(router
          logits of every layer) when config.output_router_logits is set; None: it never does
  refuse  config keys whose truthy value the family's model code turns into something the
          generic path does not do, with the name of that piece

Embedding scaling is read from the embedding module itself (`scalar_embed_scale`), the final norm
is the family's own norm module, and which layers are MoE comes from the layer modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    name: str  # what users call it, for messages and docs
    masks: str = "causal"
    rope: str = "shared"
    softcap: str | None = None
    aux: str | None = None
    refuse: dict[str, str] = field(default_factory=dict)


GENERIC: dict[str, Family] = {
    "llama": Family("Llama (generic path)"),
    "mistral": Family("Mistral (generic path)", masks="window"),
    "gemma2": Family("Gemma 2", masks="layer_types", softcap="final_logit_softcapping"),
    "gemma3_text": Family(
        "Gemma 3",
        masks="layer_types",
        rope="per_layer_type",
        softcap="final_logit_softcapping",
        refuse={"use_bidirectional_attention": "bidirectional attention"},
    ),
    "phi3": Family("Phi-3", masks="window"),
    "olmo2": Family("OLMo 2"),
    "mixtral": Family("Mixtral", masks="window", aux="switch"),
    "qwen2_moe": Family("Qwen2-MoE", masks="layer_types", aux="switch"),
    "qwen3_moe": Family("Qwen3-MoE", masks="window", aux="switch"),
    "gpt_oss": Family("gpt-oss", masks="layer_types", aux="switch"),
    "deepseek_v3": Family("DeepSeek-V3"),
}

# Families whose Hub checkpoints wrap a decoder-only LM in a multimodal model: the text config is
# what the generic path can train (see docs/architectures.md).
TEXT_OF = {"gemma3": "gemma3_text"}

# Config keys (any family) that mean training would differ from what the generic path computes.
STOCHASTIC = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "router_jitter_noise")
