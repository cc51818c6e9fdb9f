"""Tiny Gemma 3 and Idefics3 / SmolVLM checkpoints with their processors, for offline tests: the
tiny BPE tokenizer with each family's image tokens added, the family's own (PIL) image processor
at 32 px, a random model of 2 layers sized to it (fp32), all saved under one directory.

    gemma3    Gemma3Processor: `<start_of_image>` in the text becomes "\\n\\n<start_of_image>" +
              4 `<image_soft_token>` + "<end_of_image>\\n\\n"; the text layers alternate sliding
              (window 8, shorter than the rows) and full attention, so the image blocks' masks
              are tested in both kinds
    idefics3  Idefics3Processor (SmolVLM's too: idefics3_processor says why): each image split into
    smolvlm   32 px tiles (by its size, 2 to 9) plus a global one, 4 `<image>` tokens each between
              `<fake_token_around_image>` and row/column tags
"""

from __future__ import annotations

from pathlib import Path

import torch

from .census_config import tiny_config
from .tokenizer import SPECIALS, _backend
from .vision import VISION_TEMPLATE

PX, PATCH, TOKENS = 32, 8, 4  # (32 / 8)^2 patches, pooled / shuffled by 2 x 2: 4 tokens an image
GEMMA_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
FAMILIES = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
}


def _tokenizer(template: str, extra: dict[str, str] | None = None, added: list[str] | None = None):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=_backend(), bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        extra_special_tokens=extra or {}, chat_template=template,
    )  # fmt: skip
    tok.add_tokens(SPECIALS[3:] + (added or []), special_tokens=True)
    return tok


def gemma3_processor():
    import transformers

    template = VISION_TEMPLATE.replace("<image>", GEMMA_TOKENS["boi_token"])
    tok = _tokenizer(template, GEMMA_TOKENS)
    images = transformers.Gemma3ImageProcessorPil(size={"height": PX, "width": PX})
    return transformers.Gemma3Processor(
        image_processor=images, tokenizer=tok, image_seq_length=TOKENS, chat_template=template
    )


def idefics3_processor():
    """Idefics3's processor; SmolVLM's checkpoint here is saved with it too (SmolVLMProcessor needs
    num2words and a torchvision video processor, absent here): its model takes the same image
    token layout and pixel stacks."""
    import transformers

    tags = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)] + ["<global-img>"]
    tok = _tokenizer(
        VISION_TEMPLATE, added=["<fake_token_around_image>", "<image>", "<end_of_utterance>", *tags]
    )
    images = transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 3 * PX}, max_image_size={"longest_edge": PX}
    )
    return transformers.Idefics3Processor(
        image_processor=images, tokenizer=tok, image_seq_len=TOKENS, chat_template=VISION_TEMPLATE
    )


def tiny_vlm(root: Path, family: str, seed: int = 0, layers: int = 2):
    """A random checkpoint of `family` (FAMILIES) with its processor, saved under root: (model, processor)."""
    import transformers

    proc = gemma3_processor() if family == "gemma3" else idefics3_processor()
    tok = proc.tokenizer
    cfg = tiny_config(family, layers)
    t, v = cfg.text_config, cfg.vision_config
    t.vocab_size = len(tok)
    v.image_size, v.patch_size = PX, PATCH
    if family == "gemma3":
        cfg.image_token_id, cfg.mm_tokens_per_image = tok.image_token_id, TOKENS
        cfg.boi_token_index, cfg.eoi_token_index = tok.boi_token_id, tok.eoi_token_id
        t.layer_types = ["sliding_attention", "full_attention"][:layers] * (layers // 2 or 1)
        t.sliding_window = 8
    else:
        cfg.image_token_id, cfg.scale_factor = tok.convert_tokens_to_ids("<image>"), 2
        t.pad_token_id = tok.pad_token_id
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family])(cfg).eval()
    if family == "gemma3":  # its projection starts at zero, which would hide the tower from the loss
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.3)
    model.save_pretrained(root)
    proc.save_pretrained(root)
    return model, proc
