"""Online RL with images: what is not built is refused in one line, exit 2, nothing written
(these trained with exit 0 and the images dropped: the rollout prompt held one raw `<image>` id and
no pixels). Image prompts on a text-only store are refused as SFT refuses image records, and so are
KTO records with images (TRL's and LLaMA-Factory's forms; on a multimodal store they train:
tests/vision/test_vision_kto.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from horizon_cli.convert import convert
from tests.conftest import horizon, write_config, write_jsonl
from tests.support.vision import make_images, tiny_llava
from tests.train.test_train_cli import one_error_line

RL = {"num_generations": 2, "max_completion_length": 4, "rewards": [{"function": "length", "target": 3}]}
TRAIN = {"steps": 1, "batch_size": 2, "micro_batch_size": 2, "seed": 1}


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("llava")
    tiny_llava(root / "hf")
    convert(root / "hf", root / "store", dtype="float32")
    make_images(root / "data" / "imgs")
    return root


def _user(text: str, image: dict) -> list[dict]:
    return [{"role": "user", "content": [image, {"type": "text", "text": text}]}]


PROMPTS = {  # the forms a GRPO prompt names images in
    "image-part-with-file": lambda i: {"prompt": _user(f"what is {i}?", {"type": "image", "image": f"imgs/img{i % 4}.png"})},
    "trl-image-column": lambda i: {"image": f"imgs/img{i % 4}.png", "prompt": _user("what?", {"type": "image"})},
    "trl-images-column": lambda i: {"images": [f"imgs/img{i % 4}.png"], "prompt": _user("what?", {"type": "image"})},
}  # fmt: skip


def _train(root: Path, tmp_path: Path, store: Path, rows: list[dict], *flags: str, **sections):
    data = write_jsonl(root / "data" / f"{tmp_path.name}.jsonl", rows)
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", store, data, out, **{"train": TRAIN, **sections})
    r = horizon("train", cfg, *flags)
    return one_error_line(r), out


def test_grpo_missing_image_file_refused(llava, tmp_path):
    rows = [{"prompt": _user("what?", {"type": "image", "image": "imgs/none.png"})} for _ in range(4)]
    line, out = _train(llava, tmp_path, llava / "store", rows, rl=RL)
    assert "record 1: image" in line and "none.png does not exist" in line, line
    assert not out.exists()


def test_grpo_prompt_ids_with_images_refused(llava, tmp_path):
    rows = [{"prompt_input_ids": [1, 2, 3], "images": ["imgs/img0.png"]} for _ in range(4)]
    line, out = _train(llava, tmp_path, llava / "store", rows, rl=RL)
    assert "prompt_input_ids with images" in line, line
    assert not out.exists()


def test_grpo_text_prompts_with_and_without_images_refused(llava, tmp_path):
    """One text prompt rendered as a chat user message (it has an image), the next as plain text:
    one set tokenised two ways (TRL takes only conversational prompts with images)."""
    rows = [{"image": "imgs/img0.png", "prompt": "describe this"}, {"prompt": "describe this"}] * 2
    line, out = _train(llava, tmp_path, llava / "store", rows, rl=RL)
    assert "record 2: text prompts with and without images in one set" in line, line
    assert not out.exists()


def test_grpo_held_out_images_without_training_images_refused(llava, tmp_path):
    ev = write_jsonl(llava / "data" / "ev.jsonl", [PROMPTS["image-part-with-file"](i) for i in range(2)])
    rows = [{"prompt": [{"role": "user", "content": f"what is {i}?"}]} for i in range(4)]
    line, out = _train(llava, tmp_path, llava / "store", rows, rl=RL, data={"eval_path": str(ev)})
    assert "held-out prompts name images and the training prompts none" in line, line
    assert not out.exists()


@pytest.mark.parametrize("form", ["image-part-with-file", "trl-images-column"])
def test_grpo_image_prompts_on_text_only_store_refused(llava, tmp_path, tiny_store, form):
    line, out = _train(llava, tmp_path, tiny_store, [PROMPTS[form](i) for i in range(4)], rl=RL)
    assert "record 1: the prompt names images" in line and "takes text only" in line, line
    assert not out.exists()


KTO = {
    "trl": lambda i: {"images": [f"imgs/img{i % 4}.png"], "prompt": _user("what?", {"type": "image"}),
                      "completion": [{"role": "assistant", "content": "red"}], "label": i % 2 == 0},
    "llama-factory": lambda i: {"images": [f"imgs/img{i % 4}.png"], "kto_tag": i % 2 == 0,
                                "messages": [{"role": "user", "content": "<image>what?"},
                                             {"role": "assistant", "content": "red"}]},
}  # fmt: skip


@pytest.mark.parametrize("form", list(KTO))
def test_kto_images_on_text_only_store_refused(llava, tmp_path, tiny_store, form):
    line, out = _train(
        llava, tmp_path, tiny_store, [KTO[form](i) for i in range(4)], preference={"loss": "kto"}
    )
    assert "record 1 names images" in line and "takes text only" in line, line
    assert not out.exists()


def test_names_images_sees_prompt_parts():
    from horizon_cli.data.images import names_images

    assert names_images(json.loads(json.dumps(PROMPTS["image-part-with-file"](0))))
    assert not names_images({"prompt": [{"role": "user", "content": "what?"}]})


@pytest.mark.parametrize("flags", [(), ("--dry-run",)])
def test_grpo_images_lora_projector_reference_refused(llava, tmp_path, flags):
    """... by a dry run too (it runs every check a start runs), before any weight loads."""
    rows = [PROMPTS["image-part-with-file"](i) for i in range(4)]
    line, out = _train(llava, tmp_path, llava / "store", rows, *flags, rl={**RL, "beta": 0.04}, lora={"r": 4, "targets": r".*language_model.*\.(q_proj|v_proj)"},
                       train={**TRAIN, "vision": "projector"})  # fmt: skip
    assert "rl.beta: a reference for LoRA with train.vision: projector and images is not built yet" in line, (
        line
    )
    assert not out.exists()
