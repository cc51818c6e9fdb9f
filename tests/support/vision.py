"""Tiny vision-language checkpoints for offline tests and the vision demo: a random LLaVA (a CLIP
tower, a 2-layer projector, a Llama) saved with its processor (the tiny BPE tokenizer plus an
`<image>` token, CLIP's image processor at 64 px), and small images made with PIL.

    <s><|user|>\\n<image>what is this?</s>\\n<|assistant|>\\na red square</s>\\n
"""

from __future__ import annotations

from pathlib import Path

import torch

from .tokenizer import CHAT_TEMPLATE, make_tokenizer

IMAGE_PX = 64  # the tower's input size
PATCH = 16  # -> (64 / 16)^2 = 16 image tokens per image
# the tiny template, with a content that is a list of parts (text, image) as transformers' processors take it
VISION_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ m['content'] }}",
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}",
)


def tiny_processor(root: Path | None = None):
    """The tiny tokenizer with `<image>` (id 400) and a CLIP image processor at IMAGE_PX, as a
    LlavaProcessor (saved under root when given)."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    tok = make_tokenizer(chat_template=VISION_TEMPLATE)
    tok.add_tokens(["<image>"], special_tokens=True)
    images = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_PX}, crop_size={"height": IMAGE_PX, "width": IMAGE_PX}
    )
    proc = LlavaProcessor(
        image_processor=images, tokenizer=tok, patch_size=PATCH, vision_feature_select_strategy="default",
        chat_template=VISION_TEMPLATE, image_token="<image>", num_additional_image_tokens=1,
    )  # fmt: skip
    if root is not None:
        proc.save_pretrained(root)
    return proc


def tiny_llava(root: Path, seed: int = 0, layers: int = 2):
    """A random LlavaForConditionalGeneration (fp32) with the tiny processor, saved under root."""
    import transformers

    from .census_config import tiny_config

    cfg = tiny_config("llava", layers)
    proc = tiny_processor()
    cfg.text_config.vocab_size = len(proc.tokenizer)  # 401
    cfg.image_token_index = proc.tokenizer.convert_tokens_to_ids("<image>")
    cfg.vision_config.image_size, cfg.vision_config.patch_size = IMAGE_PX, PATCH
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()  # type: ignore[arg-type]
    model.save_pretrained(root)
    proc.save_pretrained(root)
    return model


def make_images(folder: Path, n: int = 4, seed: int = 0) -> list[Path]:
    """n small RGB PNGs of different sizes and colours (seeded noise over a colour)."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        h, w = 40 + 12 * i, 72 - 8 * i
        base = np.array([(60 * i) % 256, (200 - 40 * i) % 256, (90 + 50 * i) % 256], np.int16)
        px = np.clip(base + rng.integers(-40, 40, size=(h, w, 3)), 0, 255).astype(np.uint8)
        path = folder / f"img{i}.png"
        Image.fromarray(px).save(path)
        out.append(path)
    return out


QWEN_PATCH = 14  # Qwen2-VL's patch; 2 x 2 patches merge into one image token
QWEN_CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}


def tiny_qwen_vl(root: Path, mt: str = "qwen2_vl", seed: int = 0, layers: int = 2):
    """A random Qwen2-VL / Qwen2.5-VL (fp32; a 1-block tower, mrope sections for the tiny head, a
    rope theta of 100 so that wrong position ids show in the loss),
    vocabulary 400 with its image token 399 (vision start 397, end 398), saved under root."""
    import transformers

    from .census_config import tiny_config

    cfg = tiny_config(mt, layers)
    t = cfg.text_config
    t.vocab_size, t.rope_parameters = (
        400,
        {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3]},
    )
    cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id = 399, 397, 398
    v = cfg.vision_config
    v.depth = 1
    if mt == "qwen2_5_vl":  # window attention over 1 window of the tiny images; one full block
        v.out_hidden_size, v.fullatt_block_indexes, v.window_size = t.hidden_size, [0], 56
    torch.manual_seed(seed)
    model = getattr(transformers, QWEN_CLASSES[mt])(cfg).eval()
    model.save_pretrained(root)
    return model


def qwen_image_processor():
    """Qwen2-VL's slow image processor with a small pixel budget (28 x 28 .. 56 x 56 per image)."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=QWEN_PATCH)


def assert_engine_grads(eng, named: dict, projector: str | None = None) -> None:
    """A vision engine's gradients (its layers' and the tower's or projector's) equal the resident
    model's: the same trained tensors, each to 1e-5; projector: a name prefix some must carry."""
    from .oracle import engine_grads, rel_err

    grads = {**engine_grads(eng), **eng.p.embedding.trained.grad}
    assert set(grads) == {n for n, p in named.items() if p.requires_grad}
    if projector is not None:
        assert any(n.startswith(projector) for n in grads)
    for name, g in grads.items():
        assert rel_err(g, named[name].grad) < 1e-5, name


def assert_engine_weights(eng, named: dict) -> None:
    """After eng.wait(): every trained weight of a vision engine equals the resident model's, 1e-5."""
    from .oracle import engine_weights, rel_err

    ours = {**engine_weights(eng), **eng.p.embedding.trained.master}
    for name, p in named.items():
        if p.requires_grad:
            assert rel_err(ours[name], p.detach()) < 1e-5, name


def trl_vision_inputs(model, imgs: list[Path], recs: list[dict], columns: tuple[str, ...]):
    """(TRL's train dataset of the records' `columns` with record i's image imgs[i % 4] as PIL,
    the policy: an fp32 copy of `model` with its vision tower frozen, as train.vision: projector)."""
    import copy

    import datasets
    from PIL import Image

    ds = datasets.Dataset.from_dict(
        {
            "images": [[Image.open(imgs[i % 4]).convert("RGB")] for i in range(len(recs))],
            **{k: [r[k] for r in recs] for k in columns},
        }
    )
    policy = copy.deepcopy(model).float()
    for n, p in policy.named_parameters():
        p.requires_grad_(not n.startswith("model.vision_tower."))
    return ds, policy
