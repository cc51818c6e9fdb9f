"""The vision tower of two large VLMs on paper for one H200 (issue 31), by transformers' own tower
classes on the meta device (no memory, no weights): parameters, and what one sample's forward saves
for the backward (a trained tower) at 1,024 image tokens, by a saved-tensor hook as
vision/plan.py measures it; the tower's FLOPs against the language model's for the step.

    Qwen2.5-VL-72B  its ViT (32 blocks, hidden 1280, SwiGLU 3420, the 2x2 merger to 8192): 1,024
                    image tokens = 4,096 patches of 14 px (one 896 x 896 image)
    Gemma-3-27B     SigLIP-so400m (27 blocks, hidden 1152, MLP 4304) at 896 px, 4,096 patches
                    pooled to 256 tokens an image: 1,024 image tokens = 4 images (pan & scan crops)

Sizes are the published configs' (config.json of each checkpoint), entered here; the language
models' parameter counts (72.7 B, 27.0 B less the tower) likewise. Writes
bench_out/vision_paper.json.

    .venv/bin/python -m benchmarks.investigations.vision_paper
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def saved_bytes(fn) -> int:
    total = [0]

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def qwen() -> dict:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = Qwen2_5_VLVisionConfig(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                 out_hidden_size=8192, fullatt_block_indexes=[7, 15, 23, 31], window_size=112)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, dtype=torch.bfloat16)
    # its window index and rotary tables need the grid's values on the meta device's side: not
    # measured (None) — the forward cannot run there
    saved = None
    n = sum(p.numel() for p in tower.parameters())
    return {"model": "Qwen2.5-VL-72B", "lm_params": 72.7e9, "tower_params": n, "patches": 4096,
            "image_tokens": 1024, "saved_bytes_per_sample": saved}  # fmt: skip


def gemma() -> dict:
    from transformers import SiglipVisionConfig, SiglipVisionModel

    cfg = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                             num_attention_heads=16, image_size=896, patch_size=14)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        tower = SiglipVisionModel._from_config(cfg, dtype=torch.bfloat16)
    pix = torch.empty(4, 3, 896, 896, dtype=torch.bfloat16, device="meta")
    saved = saved_bytes(lambda: tower(pixel_values=pix))
    n = sum(p.numel() for p in tower.parameters()) + 1152 * 5376  # + the projector (to the LM's 5376)
    return {"model": "Gemma-3-27B", "lm_params": 27.0e9 - n, "tower_params": n, "patches": 4 * 4096,
            "image_tokens": 1024, "saved_bytes_per_sample": saved}  # fmt: skip


def paper(r: dict, text_tokens: int = 512) -> dict:
    """Host/device bytes of the tower at bf16 compute; its FLOP share of a step (forward +
    backward: 6 x params x tokens for trained weights, 4 x for a frozen tower that still
    backpropagates nothing: 2 x)."""
    seq = r["image_tokens"] + text_tokens
    lm = 6 * r["lm_params"] * seq
    frozen, trained = 2 * r["tower_params"] * r["patches"], 6 * r["tower_params"] * r["patches"]
    return {
        **r,
        "device_tower_weights_bytes": 2 * r["tower_params"],
        "host_trained_state_bytes": 16 * r["tower_params"],
        "device_grad_sums_bytes": 4 * r["tower_params"],
        "lm_flops_per_sample": lm,
        "tower_flops_share_frozen": frozen / (frozen + lm),
        "tower_flops_share_trained": trained / (trained + lm),
        "lm_host_bytes_exact": 14 * r["lm_params"],
    }


def main() -> None:
    out = [paper(qwen()), paper(gemma())]
    (REPO / "bench_out").mkdir(exist_ok=True)
    (REPO / "bench_out" / "vision_paper.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
