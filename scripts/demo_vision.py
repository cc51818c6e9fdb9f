"""`make demo-vision`: vision-language fine-tuning end to end, offline, on the CPU, in about a minute.

No small real VLM can be built offline here, so the model is a tiny *random* LLaVA (a CLIP tower,
a 2-layer projector, a 2-layer Llama; tests/support/vision.py) with its processor; what the
demo shows is the pipeline, not a capable model:

1. build the tiny LLaVA and its processor, and 4 images made on the fly (PIL: a colour each)
2. `horizon convert` it into a store (the tower and projector carried, the processor's files copied)
3. `horizon train`: chats with an image each ("what colour is this?" -> the colour's name),
   tokenized by the checkpoint's processor, the tower on the device (train.vision: projector: the
   projector trained with the language model, the vision encoder frozen), the loss falling
4. the HF export answers each image through transformers' own LlavaForConditionalGeneration and
   processor (greedy), before and after

Run from the checkout's root as a module (it imports tests.support): `python -m scripts.demo_vision`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / ".cache" / "demo-vision"
RUN = REPO / "runs" / "demo-vision"
HORIZON = [sys.executable, "-m", "horizon_cli.cli"]
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 230), "yellow": (240, 220, 40)}


def banner(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def run(cmd: list) -> None:
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=REPO)


def images(folder: Path) -> dict[str, Path]:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    out = {}
    for name, rgb in COLOURS.items():
        px = np.clip(np.array(rgb) + rng.integers(-25, 25, size=(48, 48, 3)), 0, 255).astype(np.uint8)
        out[name] = folder / f"{name}.png"
        Image.fromarray(px).save(out[name])
    return out


def data(path: Path, imgs: dict[str, Path]) -> None:
    rows = []
    for _ in range(10):
        for name, img in imgs.items():
            rows.append({
                "messages": [
                    {"role": "user", "content": [{"type": "image", "image": f"images/{img.name}"},
                                                 {"type": "text", "text": "what colour is this?"}]},
                    {"role": "assistant", "content": name},
                ]
            })  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def config(path: Path, store: Path, data_path: Path) -> None:
    import yaml

    cfg = {
        "model": {"path": str(store)},
        "data": {"path": str(data_path), "max_seq_len": 64},
        "train": {"steps": 40, "batch_size": 8, "micro_batch_size": 4, "vision": "projector"},
        "optim": {"lr": 3.0e-3, "grad_clip": 1.0},
        "schedule": {"kind": "cosine", "warmup_steps": 4, "min_lr_ratio": 0.1},
        "engine": {"device": "cpu", "dtype": "float32"},
        "output": {"dir": str(RUN), "save_every": 0, "keep_last": 1, "export": True},
        "log": {"every": 5},
    }
    path.write_text(yaml.safe_dump(cfg))


def ask(model_dir: Path, imgs: dict[str, Path]) -> dict[str, str]:
    """transformers' own model and processor, greedy, one image at a time."""
    import torch
    import transformers
    from PIL import Image

    proc = transformers.AutoProcessor.from_pretrained(model_dir)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    msgs = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is this?"}]}
    ]
    text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    out = {}
    for name, img in imgs.items():
        inputs = proc(
            text=[text],
            images=[Image.open(img).convert("RGB")],
            add_special_tokens=False,
            return_tensors="pt",
        )
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        out[name] = proc.tokenizer.decode(
            ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True
        ).strip()
    return out


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tests.support.vision import tiny_llava

    shutil.rmtree(WORK, ignore_errors=True)
    shutil.rmtree(RUN, ignore_errors=True)
    banner("1/4 a tiny RANDOM LLaVA (no small real VLM builds offline) and 4 images made now")
    tiny_llava(WORK / "hf", seed=0)
    imgs = images(WORK / "images")
    data(WORK / "colours.jsonl", imgs)
    banner("2/4 convert it into a horizon store")
    run([*HORIZON, "convert", WORK / "hf", WORK / "store", "--dtype", "float32"])
    before = ask(WORK / "hf", imgs)
    banner("3/4 fine-tune on 40 chats with an image each (the projector and the language model)")
    config(WORK / "demo-vision.yaml", WORK / "store", WORK / "colours.jsonl")
    run([*HORIZON, "train", WORK / "demo-vision.yaml", "--dry-run"])
    run([*HORIZON, "train", WORK / "demo-vision.yaml"])
    banner("4/4 the HF export, answering through transformers' own model and processor")
    after = ask(RUN / "export", imgs)
    for name in imgs:
        print(f"  image {name:6s}  before: {before[name]!r:14s}  after: {after[name]!r}")
    print(f"\nmetrics: {RUN / 'metrics.jsonl'}   HF export: {RUN / 'export'}")


if __name__ == "__main__":
    main()
