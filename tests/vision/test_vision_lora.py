"""LoRA adapters on the projector (`train.vision: projector` with `lora:`, vision/adapters.py): a tiny
random LLaVA whose language model and projector (`multi_modal_projector.linear_1/linear_2`) carry
adapters, the vision encoder frozen, trains as peft on transformers' LlavaForConditionalGeneration
with the same target modules + torch AdamW, given the processor's pixels: the loss of 3 steps,
every adapter gradient of the first and every adapter after 3 steps (fp32, 1e-5). Through the CLI
the run's adapter names the projector's modules, its keys are peft's own on the multimodal model
(PeftModel.from_pretrained loads every one of them and gives the logits of the merged export),
and the merged export (the projector's adapters merged into the carried weights) equals peft's
merge_and_unload; generate on the run dir equals peft's greedy. Qwen2-VL's merger adapters are
named as peft names them; --dry-run counts the adapters; `train.vision: all` with lora, dropout on
the projector's adapters and Gemma 3's projector (no linear layer) are refused in one line."""

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
from horizon_cli.errors import InputError
from horizon_cli.fmt import fmt_bytes
from horizon_cli.lora.setup import lora_setup
from horizon_cli.store import Store
from horizon_cli.vision.adapters import projector_targets
from horizon_cli.vision.run import image_data, vision_stage
from tests.conftest import horizon, write_config
from tests.support.oracle import engine_grads, hf_batch_loss, one_thread, rel_err  # noqa: F401 (autouse fixture)
from tests.support.vision import make_images, tiny_llava

peft = pytest.importorskip("peft")

LM = r".*language_model.*\.(q_proj|v_proj|down_proj)"
PROJ = ("model.multi_modal_projector.linear_1", "model.multi_modal_projector.linear_2")
BOTH = LM + r"|model\.multi_modal_projector\.linear_[12]"
HP = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 0.5


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    model = tiny_llava(root / "hf")
    convert(root / "hf", root / "store", dtype="float32")
    return root, model


def records(imgs: list[Path], n: int = 6) -> list[dict]:
    return [
        {"images": [f"imgs/{imgs[i % 4].name}"],
         "conversations": [{"from": "human", "value": f"<image>what is {i}?"}, {"from": "gpt", "value": f"colour {i} here"}]}
        for i in range(n)
    ]  # fmt: skip


def write_data(folder: Path) -> Path:
    imgs = make_images(folder / "imgs")
    data = folder / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(imgs)))
    return data


def pixels(mb) -> dict:
    return {"input_ids": mb.input_ids, "pixel_values": mb.media["pixel_values"]}


def test_projector_targets_are_its_linear_layers(vlm):
    root, _ = vlm
    arch = Store.open(root / "store").arch
    ts = projector_targets(arch, "projector")
    assert [t.module for t in ts] == list(PROJ)
    assert projector_targets(arch, "frozen") == []
    for vision, dropout, says in (
        ("all", 0.0, "train.vision: all: with lora"),
        ("projector", 0.1, "lora.dropout"),
    ):
        with pytest.raises(InputError) as e:
            projector_targets(arch, vision, dropout)
        assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_named_targets_leave_the_tower_out(vlm):
    """lora.targets as names (the default's q_proj ... down_proj): the language model's layers,
    the tower's modules of the same names left out as LLaMA-Factory's freeze_vision_tower leaves
    them (refused before as "(Linear), not a linear layer"); a regex naming one still matches none."""
    from horizon_cli.lora.targets import resolve_targets

    root, _ = vlm
    arch = Store.open(root / "store").arch
    got = resolve_targets(LoraConfig().targets, arch)
    names = [t.module for layer in got for t in layer]
    assert len(names) == arch.n_layers * 7 and all(".language_model." in n for n in names), names
    with pytest.raises(InputError, match="matches no module"):
        resolve_targets(r".*vision_tower.*\.k_proj", arch)


def test_qwen_vl_merger_adapters_are_named_as_peft_names_them(tmp_path):
    """Qwen2-VL's projector is the tower's merger (visual.merger.mlp.0 / mlp.2): the adapter
    config's target_modules make peft adapt exactly the run's modules, under the run's keys."""
    from horizon_cli.lora.peft import saved_targets
    from tests.support.vision import tiny_qwen_vl

    model = tiny_qwen_vl(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    arch = Store.open(tmp_path / "store").arch
    tower = projector_targets(arch, "projector")
    assert [t.module for t in tower] == ["model.visual.merger.mlp.0", "model.visual.merger.mlp.2"]
    setup = lora_setup(LoraConfig(r=4, alpha=8, targets=LM), arch, tower=tower)
    for targets in (LM, ["q_proj", "v_proj"]):  # a regular expression, a list of names
        saved = saved_targets(targets, setup.targets, setup.tower)
        pm = peft.get_peft_model(
            copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8, target_modules=saved)
        )
        keys = set(peft.get_peft_model_state_dict(pm, adapter_name="default"))
        assert {k for k in keys if ".visual." in k} == {k for k in setup.expected() if ".visual." in k}
        if isinstance(targets, str):
            assert keys == set(setup.expected())


def test_a_projector_without_linear_layers_refused(tmp_path):
    """Gemma 3's projector is a bare weight (mm_input_projection_weight): nothing for LoRA to adapt."""
    from tests.support.vision_families import tiny_vlm

    tiny_vlm(tmp_path / "hf", "gemma3")
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    with pytest.raises(InputError, match="projector has no linear layer"):
        projector_targets(Store.open(tmp_path / "store").arch, "projector")


def test_lm_and_projector_adapters_equal_peft(vlm, tmp_path):
    root, model = vlm
    store = Store.open(root / "store")
    torch.manual_seed(1)  # random A and B (lora.init): every adapter tensor has a gradient
    pm = peft.get_peft_model(
        copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8, target_modules=BOTH, init_lora_weights=False)
    )
    pm.save_pretrained(tmp_path / "init")
    pm.train(False)
    theirs0 = peft.get_peft_model_state_dict(pm, adapter_name="default")
    assert any(".multi_modal_projector.linear_1.lora_A" in k for k in theirs0)
    cfg = LoraConfig(r=4, alpha=8, targets=LM, init=str(tmp_path / "init"))
    setup = lora_setup(cfg, store.arch, tower=projector_targets(store.arch, "projector"))
    eng = Engine(
        store, EngineConfig(device="cpu", dtype="float32", loss_chunk=16),
        OptimConfig(kernel="torch", grad_clip=CLIP, **HP), lora=setup, stage=vision_stage(store, "projector", setup),
    )  # fmt: skip
    dcfg = DataConfig(path=str(write_data(tmp_path / "data")), max_seq_len=128)
    ts = prepare_data(
        dcfg, None, vocab_size=store.arch.vocab, log=lambda s: None, images=image_data(store)
    ).train
    steps = [collate(ts.rows(r), 2, 0) for r in ([0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 0, 1])]
    named = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    assert named and all(".lora_" in n for n in named)
    opt = torch.optim.AdamW(list(named.values()), **HP)
    tower = eng.p.embedding.trained
    try:
        for s, mbs in enumerate(steps):
            opt.zero_grad(set_to_none=True)
            ref = hf_batch_loss(pm, mbs, pixels)
            if s == 0:  # every adapter's gradient of the first step, before the update
                loss_sum, tokens, _ = eng.forward_backward(mbs)
                eng.t.synchronize()
                assert abs(loss_sum / tokens - ref) / ref < 1e-5
                by_key = {k.replace(".default.", "."): p for k, p in named.items()}
                assert set(tower.grad) == {k for k in theirs0 if ".multi_modal_projector." in k}
                grads = {**engine_grads(eng), **tower.grad}
                assert set(grads) == set(by_key) == set(theirs0)
                for k, g in grads.items():
                    assert rel_err(g, by_key[k].grad) < 1e-5, k
            res = eng.step(mbs, HP["lr"])
            torch.nn.utils.clip_grad_norm_(list(named.values()), CLIP)
            opt.step()
            assert res.loss == pytest.approx(ref, rel=1e-5), s
        eng.wait()
        ours = {**eng.host.tensors(), **tower.master}
        theirs = peft.get_peft_model_state_dict(pm, adapter_name="default")
        assert set(ours) == set(theirs)
        for k in theirs:
            assert rel_err(ours[k], theirs[k]) < 1e-5, k
    finally:
        eng.close()


def test_cli_adapter_loads_in_peft_and_merged_export_equals_merge_and_unload(vlm, tmp_path):
    """The run's adapter through peft on the multimodal model, and the merged export in
    transformers; a resume (1 + 1 steps) writes the adapter of 2 steps bit for bit."""
    import transformers
    from safetensors.torch import load_file

    root, model = vlm
    data = write_data(tmp_path / "data")

    def cfg(name: str, steps: int):
        return write_config(
            tmp_path / f"{name}.yaml", root / "store", data, tmp_path / name,
            train={"steps": steps, "batch_size": 2, "micro_batch_size": 1, "vision": "projector"},
            lora={"r": 4, "alpha": 8, "targets": LM}, optim={"lr": 2e-2},
            schedule={"kind": "constant", "warmup_steps": 0}, output={"save_every": 1, "export": name == "whole"},
        )  # fmt: skip

    r = horizon("train", cfg("whole", 2))
    assert r.exit_code == 0, r.output
    assert horizon("train", cfg("parts", 1)).exit_code == 0
    r = horizon("train", cfg("parts", 2))
    assert r.exit_code == 0 and "resuming" in r.output, r.output
    adapter = tmp_path / "whole" / "adapter"
    ours = load_file(str(adapter / "adapter_model.safetensors"))
    parts = load_file(str(tmp_path / "parts" / "adapter" / "adapter_model.safetensors"))
    assert ours.keys() == parts.keys() and all(torch.equal(ours[k], parts[k]) for k in ours)
    assert {k for k in ours if ".multi_modal_projector." in k} == {
        f"base_model.model.{m}.lora_{w}.weight" for m in PROJ for w in "AB"
    }
    assert all(ours[k].any() for k in ours if ".lora_B." in k)  # trained (B starts at zero)
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(model), adapter).eval()
    loaded = peft.get_peft_model_state_dict(pm, adapter_name="default")
    assert loaded.keys() == ours.keys() and all(torch.equal(loaded[k], ours[k]) for k in ours)
    mb = collate(
        prepare_data(
            DataConfig(path=str(data), max_seq_len=128), None, vocab_size=401, log=lambda s: None,
            images=image_data(Store.open(root / "store")),
        ).train.rows([0, 1]), 2, 0,
    )[0]  # fmt: skip
    merged = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "whole" / "export").eval()
    with torch.no_grad():
        want, got = pm(**pixels(mb)).logits, merged(**pixels(mb)).logits
        base = model(**pixels(mb)).logits
    assert rel_err(got, want) < 1e-5 and rel_err(base, want) > 1e-3
    ref = pm.merge_and_unload().state_dict()
    mine = merged.state_dict()
    assert mine.keys() == ref.keys()
    for k in ref:
        assert rel_err(mine[k], ref[k]) < 1e-6, k
    proj = [k for k in ref if k.startswith("model.multi_modal_projector.") and k.endswith(".weight")]
    orig = model.state_dict()
    assert len(proj) == 2 and all(not torch.equal(mine[k], orig[k]) for k in proj)


def test_generate_from_the_run_applies_the_projector_adapters(vlm, tmp_path):
    """`horizon generate` on the LoRA run dir with an image prompt equals peft's greedy generate
    with the run's adapter (projector adapters included)."""
    from PIL import Image
    from transformers import AutoProcessor

    root, model = vlm
    data = write_data(tmp_path / "data")
    cfg = write_config(
        tmp_path / "run.yaml", root / "store", data, tmp_path / "run",
        train={"steps": 2, "batch_size": 2, "micro_batch_size": 2, "vision": "projector"},
        lora={"r": 4, "alpha": 8, "targets": LM}, optim={"lr": 5e-2}, schedule={"kind": "constant", "warmup_steps": 0},
    )  # fmt: skip
    assert horizon("train", cfg).exit_code == 0
    prompt = {"messages": [{"role": "user", "content": [{"type": "image", "image": "data/imgs/img1.png"},
                                                        {"type": "text", "text": "what is 1?"}]}]}  # fmt: skip
    (tmp_path / "p.jsonl").write_text(json.dumps(prompt) + "\n")
    out = tmp_path / "o.jsonl"
    r = horizon(
        "generate",
        tmp_path / "run",
        "--prompts",
        tmp_path / "p.jsonl",
        "--max-new-tokens",
        "6",
        "--output",
        out,
    )
    assert r.exit_code == 0, r.output
    got = json.loads(out.read_text())["completion_ids"]
    proc = AutoProcessor.from_pretrained(root / "hf")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is 1?"}]}]
    text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    pics = [Image.open(tmp_path / "data" / "imgs" / "img1.png").convert("RGB")]
    inputs = proc(text=[text], images=pics, add_special_tokens=False, return_tensors="pt")
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "run" / "adapter").eval()
    with torch.no_grad():
        ref = pm.generate(**inputs, max_new_tokens=6, do_sample=False)[
            0, inputs["input_ids"].shape[1] :
        ].tolist()
        logits = pm(**inputs).logits[0, -1]
        with pm.disable_adapter():
            off = pm(**inputs).logits[0, -1]
    assert rel_err(off, logits) > 1e-3  # the adapters move the logits
    assert got == ref[: len(got)] and len(got) >= 1, (got, ref)


def test_dry_run_counts_the_projector_adapters(vlm, tmp_path):
    """--dry-run's host row for the tower's trained state is the adapters' 16 B a parameter."""
    root, _ = vlm
    data = write_data(tmp_path / "data")
    out = tmp_path / "plan.json"
    cfg = write_config(
        tmp_path / "c.yaml", root / "store", data, tmp_path / "run",
        train={"steps": 1, "batch_size": 2, "micro_batch_size": 2, "vision": "projector"},
        lora={"r": 4, "alpha": 8, "targets": LM},
    )  # fmt: skip
    r = horizon("train", cfg, "--dry-run", "--json", out)
    assert r.exit_code == 0, r.output
    ts = projector_targets(Store.open(root / "store").arch, "projector")
    n = sum(4 * (t.in_features + t.out_features) for t in ts)
    plan = json.loads(out.read_text())
    assert f"trained state {fmt_bytes(16 * n)} on the host" in " ".join(r.output.split())
    assert not (tmp_path / "run").exists() and plan["fits"]
