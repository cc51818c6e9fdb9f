"""QLoRA with images: a tiny random LLaVA converted with `--quantize nf4` keeps its vision tower
and projector unquantized (bitwise the checkpoint's), and LoRA on the NF4 language model with
the frozen tower's features merged trains as peft on transformers' LLaVA whose language model is
the store's dequantized NF4 base (`horizon export` of the store), given the processor's pixels:
the loss of 3 steps and every adapter tensor after them (fp32, 1e-5)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from horizon_cli.config.schema import DataConfig, EngineConfig, LoraConfig, OptimConfig
from horizon_cli.convert import convert
from horizon_cli.data import collate, prepare_data
from horizon_cli.engine import Engine
from horizon_cli.export import export
from horizon_cli.lora.setup import lora_setup
from horizon_cli.store import Store
from horizon_cli.store.carried import FILE
from horizon_cli.vision.run import image_data, vision_stage
from tests.support.oracle import hf_batch_loss, one_thread, rel_err  # noqa: F401 (autouse fixture)
from tests.support.vision import make_images, tiny_llava

peft = pytest.importorskip("peft")

TARGETS = r".*language_model.*\.(q_proj|v_proj|down_proj)"
TOWER = ("model.vision_tower.", "model.multi_modal_projector.")
LR = 2e-3


def records(imgs: list[Path]) -> list[dict]:
    return [
        {"images": [f"imgs/{imgs[i % 4].name}"],
         "conversations": [{"from": "human", "value": f"<image>what is {i}?"}, {"from": "gpt", "value": f"colour {i} here"}]}
        for i in range(6)
    ]  # fmt: skip


def test_qlora_with_images_equals_peft_on_the_dequantized_base(tmp_path):
    import transformers
    from safetensors.torch import load_file

    model = tiny_llava(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32", quantize="nf4")
    store = Store.open(tmp_path / "store")
    carried = load_file(str(tmp_path / "store" / "hf" / FILE))  # the checkpoint's names
    disk = load_file(str(tmp_path / "hf" / "model.safetensors"))
    n_tower = sum(n.startswith(TOWER) for n, _ in model.named_parameters())
    assert len(carried) == n_tower  # the tower and projector, unquantized, bit for bit
    assert all(t.dtype == torch.float32 and torch.equal(t, disk[k]) for k, t in carried.items())
    export(store.root, tmp_path / "deq")  # the language model's NF4 weights dequantized
    base = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "deq").float()
    q = base.model.language_model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q, model.model.language_model.layers[0].self_attn.q_proj.weight)

    torch.manual_seed(1)  # random A and B (lora.init): every adapter tensor has a gradient
    pm = peft.get_peft_model(
        copy.deepcopy(base),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False),
    )
    pm.save_pretrained(tmp_path / "init")
    pm.train(False)
    setup = lora_setup(LoraConfig(r=4, alpha=8, targets=TARGETS, init=str(tmp_path / "init")), store.arch)
    eng = Engine(
        store, EngineConfig(device="cpu", dtype="float32", loss_chunk=16), OptimConfig(kernel="torch", lr=LR),
        lora=setup, stage=vision_stage(store, "frozen", lora=True),
    )  # fmt: skip
    imgs = make_images(tmp_path / "data" / "imgs")
    data = tmp_path / "data" / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(imgs)))
    cfg = DataConfig(path=str(data), max_seq_len=128)
    ts = prepare_data(
        cfg, None, vocab_size=store.arch.vocab, log=lambda s: None, images=image_data(store)
    ).train
    steps = [collate(ts.rows(r), 2, 0) for r in ([0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 0, 1])]
    params = [p for n, p in pm.named_parameters() if p.requires_grad]
    assert params and all(".lora_" in n for n, p in pm.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    try:
        for s, mbs in enumerate(steps):
            opt.zero_grad(set_to_none=True)
            ref = hf_batch_loss(
                pm, mbs, lambda mb: {"input_ids": mb.input_ids, "pixel_values": mb.media["pixel_values"]}
            )
            res = eng.step(mbs, LR)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            assert res.loss == pytest.approx(ref, rel=1e-5), s
        eng.wait()
        ours, theirs = eng.host.tensors(), peft.get_peft_model_state_dict(pm, adapter_name="default")
        assert set(ours) == set(theirs)
        for k in theirs:
            assert rel_err(ours[k], theirs[k]) < 1e-5, k
    finally:
        eng.close()
