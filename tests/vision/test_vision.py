"""Vision-language fine-tuning (horizon_cli/vision): a tiny random LLaVA with its processor and 4
small images made here. The processor's token ids equal horizon's for each data form; the loss,
every gradient and 3 AdamW steps of the streamed language model with the frozen tower's features
merged equal transformers' own LlavaForConditionalGeneration called with the processor's outputs
+ torch AdamW (fp32, 1e-5); bad image input is one line, exit 2, nothing trained."""

import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from datasets import load_dataset
from PIL import Image

from horizon_cli.config.schema import DataConfig, EngineConfig, OptimConfig
from horizon_cli.convert import convert
from horizon_cli.data import IGNORE, collate, prepare_data
from horizon_cli.engine import Engine
from horizon_cli.store import Store
from horizon_cli.vision.run import image_data, vision_stage
from tests.conftest import horizon, write_config
from tests.support.oracle import engine_grads, engine_weights, hf_batch_loss, one_thread, rel_err  # noqa: F401 (autouse fixture)
from tests.support.vision import assert_engine_grads, assert_engine_weights, make_images, tiny_llava

HP = dict(lr=2e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, grad_clip=0.5)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    model = tiny_llava(root / "hf")
    convert(root / "hf", root / "store", dtype="float32")
    return root, model


def write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_parts(i: int, img: str) -> dict:  # transformers' / TRL's chat form with a path in the part
    return {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "image": img}, {"type": "text", "text": f"what is {i}?"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": f"colour {i} here"}]},
        ]
    }


def forms(imgs: list[str]) -> dict[str, list[dict]]:
    """The same 4 examples in each data form horizon reads."""
    return {
        "chat_parts": [chat_parts(i, imgs[i]) for i in range(4)],
        "image_url": [
            {"messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": imgs[i]}},
                                             {"type": "text", "text": f"what is {i}?"}]},
                {"role": "assistant", "content": f"colour {i} here"}]}
            for i in range(4)
        ],
        "trl_images": [
            {"images": [imgs[i]], "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"what is {i}?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": f"colour {i} here"}]}]}
            for i in range(4)
        ],
        "sharegpt": [
            {"images": [imgs[i]], "conversations": [
                {"from": "human", "value": f"<image>what is {i}?"}, {"from": "gpt", "value": f"colour {i} here"}]}
            for i in range(4)
        ],
        "alpaca": [
            {"images": [imgs[i]], "instruction": f"<image>what is {i}?", "input": "", "output": f"colour {i} here"}
            for i in range(4)
        ],
    }  # fmt: skip


def prepared(store, path: Path, **data):
    cfg = DataConfig(path=str(path), max_seq_len=128, **data)
    return prepare_data(cfg, None, vocab_size=store.arch.vocab, log=lambda s: None, images=image_data(store))


def processor_rows(proc, imgs: list[Path]) -> list[list[int]]:
    """What the processor itself gives for the 4 examples (chat template, then processor call)."""
    out = []
    for i in range(4):
        msgs = chat_parts(i, "")["messages"]
        msgs[0]["content"][0] = {"type": "image"}
        text = proc.apply_chat_template(msgs, tokenize=False)
        ids = proc(text=[text], images=[Image.open(imgs[i]).convert("RGB")], add_special_tokens=False)
        out.append(list(ids["input_ids"][0]))
    return out


@pytest.mark.parametrize("form", ["chat_parts", "image_url", "trl_images", "sharegpt", "alpaca"])
def test_processor_ids_equal_horizons_per_form(vlm, tmp_path, form):
    from transformers import AutoProcessor

    root, _ = vlm
    store = Store.open(root / "store")
    imgs = make_images(tmp_path / "data" / "imgs")
    data = write(tmp_path / "data" / "d.jsonl", forms([f"imgs/{p.name}" for p in imgs])[form])
    ts = prepared(store, data).train
    proc = AutoProcessor.from_pretrained(root / "hf")
    want = processor_rows(proc, imgs)
    assert [list(ts[i].input_ids) for i in range(4)] == want
    assert ts.stats["images"] == 4 and ts.stats["image_tokens"] == 4 * 16
    for i in range(4):
        pv = proc(text=["<image>"], images=[Image.open(imgs[i]).convert("RGB")])["pixel_values"]
        assert torch.equal(torch.as_tensor(ts[i].media["pixel_values"]), torch.as_tensor(pv))
        lab = ts[i].labels
        said = proc.tokenizer.decode([int(t) for t in lab if t != IGNORE])
        assert said.startswith(f"colour {i} here")


def test_the_data_sections_chat_template_and_kwargs_render_image_records(vlm, tmp_path):
    """data.chat_template and data.chat_template_kwargs render image records too, through the
    processor (they reached only the tokenizer of text records), and key the cache."""
    from transformers import AutoProcessor

    root, _ = vlm
    store = Store.open(root / "store")
    imgs = make_images(tmp_path / "data" / "imgs")
    data = write(tmp_path / "data" / "d.jsonl", forms([f"imgs/{p.name}" for p in imgs])["chat_parts"])
    proc = AutoProcessor.from_pretrained(root / "hf")
    plain = processor_rows(proc, imgs)
    proc.chat_template = "{% if shout %}LOUD {% endif %}" + proc.chat_template
    proc.apply_chat_template = functools.partial(proc.apply_chat_template, shout=True)
    want = processor_rows(proc, imgs)
    assert want != plain
    ts = prepared(store, data, chat_template=proc.chat_template, chat_template_kwargs={"shout": True}).train
    assert [list(ts[i].input_ids) for i in range(4)] == want
    cfg = DataConfig(path=str(data), max_seq_len=128)
    keys = {image_data(store).key(load_dataset("json", data_files=str(data))["train"], c, data.parent)
            for c in (cfg, replace(cfg, chat_template_kwargs={"shout": True}))}  # fmt: skip
    assert len(keys) == 2


def test_a_chat_template_without_image_placeholders_is_one_line(vlm, tmp_path):
    """A data.chat_template that drops image parts: the processor's refusal named with the record
    (a ValueError traceback before), for training records and GRPO's prompts alike."""
    from horizon_cli.errors import InputError
    from horizon_cli.vision.prompts import encode_prompt, load_processor
    from horizon_cli.vision.records import image_example

    root, _ = vlm
    store = Store.open(root / "store")
    imgs = make_images(tmp_path / "data" / "imgs")
    rows = forms([f"imgs/{p.name}" for p in imgs])["chat_parts"]
    data = write(tmp_path / "data" / "d.jsonl", rows)
    blind = "{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}"
    with pytest.raises(
        InputError,
        match=r"d.jsonl: record 1: the processor refused the record as its chat template renders it \(ValueError: .*data.chat_template",
    ):
        prepared(store, data, chat_template=blind)
    proc = load_processor(root / "hf", "model")
    proc.chat_template = blind
    prompt = image_example({"messages": rows[0]["messages"][:1]}, "p.jsonl: record 1", data.parent)
    with pytest.raises(InputError, match=r"p.jsonl: record 1: the processor refused"):
        encode_prompt(proc, prompt, "p.jsonl: record 1", 768 * 768, 32 * 32)


def hf_step_loss(model, mbs) -> float:
    """Summed CE over the global batch's label tokens / their count, backward; with pixel_values."""
    return hf_batch_loss(
        model, mbs, lambda mb: {"input_ids": mb.input_ids, "pixel_values": mb.media["pixel_values"]}
    )


TOWER = ("model.vision_tower.", "model.multi_modal_projector.")
KEY_BIAS = "self_attn.k_proj.bias"  # softmax is invariant to it: its gradient is rounding noise


def trains(name: str, vision: str) -> bool:
    """Whether train.vision trains the HF model's parameter `name`."""
    if not name.startswith(TOWER):
        return True
    return vision == "all" or (vision == "projector" and name.startswith(TOWER[1]))


@pytest.mark.parametrize("vision", ["frozen", "projector", "all"])
def test_tower_loss_grads_adamw_match_transformers(vlm, tmp_path, vision):
    root, model0 = vlm
    store = Store.open(root / "store")
    imgs = make_images(tmp_path / "data" / "imgs")
    rows = forms([f"imgs/{p.name}" for p in imgs])["chat_parts"]
    rows = rows + [chat_parts(i, f"imgs/img{(i + 1) % 4}.png") for i in range(4)]
    rows.append(
        {"messages": [{"role": "user", "content": "plain text"}, {"role": "assistant", "content": "ok"}]}
    )
    ts = prepared(store, write(tmp_path / "data" / "d.jsonl", rows)).train
    steps = [collate(ts.rows(r), 2, 0) for r in ([0, 1, 2, 8], [3, 4, 5, 6], [7, 8, 0, 5])]
    model = type(model0).from_pretrained(root / "hf").float()
    model.train(False)
    for n, p in model.named_parameters():
        p.requires_grad_(trains(n, vision))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=HP["lr"], betas=tuple(HP["betas"]), eps=HP["eps"], weight_decay=HP["weight_decay"]
    )
    eng = Engine(
        store, EngineConfig(device="cpu", dtype="float32", loss_chunk=16), OptimConfig(kernel="torch", **HP),
        stage=vision_stage(store, vision),
    )  # fmt: skip
    try:
        for s, mbs in enumerate(steps):
            assert sum(int(mb.media["pixel_values"].shape[0]) for mb in mbs) >= 3
            opt.zero_grad(set_to_none=True)
            ref = hf_step_loss(model, mbs)
            if s == 0:  # every gradient of the first step, before the update
                loss_sum, tokens, _ = eng.forward_backward(mbs)
                eng.t.synchronize()
                assert abs(loss_sum / tokens - ref) / ref < 1e-5
                named = dict(model.named_parameters())
                tower = eng.p.embedding.trained
                grads = {**engine_grads(eng), **(tower.grad if tower is not None else {})}
                assert set(grads) == {n for n, p in named.items() if p.requires_grad}
                for name, g in grads.items():
                    ref_g = named[name].grad  # None: unused (CLIP's layers past vision_feature_layer)
                    if ref_g is None:
                        assert not g.any(), name
                    elif name.endswith(KEY_BIAS):
                        assert g.abs().max() < 1e-6 and ref_g.abs().max() < 1e-6, name
                    else:
                        assert rel_err(g, ref_g) < 1e-5, name
                assert any(n.startswith("model.language_model.embed_tokens") for n in grads)
            res = eng.step(mbs, HP["lr"])
            torch.nn.utils.clip_grad_norm_(params, HP["grad_clip"])
            opt.step()
            assert abs(res.loss - ref) / ref < 1e-5, (s, res.loss, ref)
        eng.wait()
        ours = {**engine_weights(eng), **(tower.master if tower is not None else {})}
        theirs = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        assert set(ours) == set(theirs)
        for name, p in theirs.items():
            if name.endswith(KEY_BIAS):  # gradient 0 in exact arithmetic (checked above): AdamW turns
                continue  # both sides' rounding noise into lr-sized steps, so the weights are not compared
            assert rel_err(ours[name], p) < 1e-5, name
    finally:
        eng.close()


def test_image_records_train_and_bad_input_refused(vlm, tmp_path):
    root, _ = vlm
    imgs = make_images(tmp_path / "data" / "imgs")
    good = forms([f"imgs/{p.name}" for p in imgs])["sharegpt"]

    def run(rows, name, store=root / "store", **train):
        data = write(tmp_path / "data" / f"{name}.jsonl", rows)
        targets = r".*language_model.*\.(q_proj|v_proj)"  # the tower's linears are no LoRA targets
        lora = {"lora": {"r": 4, "alpha": 8, "targets": targets}} if name.startswith("lora") else {}
        cfg = write_config(
            tmp_path / f"{name}.yaml", store, data, tmp_path / f"run-{name}",
            train={"steps": 1, "batch_size": 2, "micro_batch_size": 2, **train}, **lora,
        )  # fmt: skip
        return horizon("train", cfg)

    r = run(good, "good")
    assert r.exit_code == 0, r.output
    assert "4 images, 64 image tokens" in r.output
    r = run(good, "lora_frozen_tower")  # adapters on the language model, the tower frozen
    assert r.exit_code == 0 and "done: 1 steps" in r.output, r.output
    (tmp_path / "data" / "imgs" / "broken.png").write_bytes(b"not a png")
    two = [
        {
            **good[0],
            "conversations": [{"from": "human", "value": "<image><image>hi"}, good[0]["conversations"][1]],
        }
    ]
    cases = {
        "missing": ([{**good[0], "images": ["imgs/nope.png"]}], "does not exist"),
        "unreadable": ([{**good[0], "images": ["imgs/broken.png"]}], "is unreadable"),
        "more_placeholders": (two, "more image placeholders than images"),
        "fewer_placeholders": ([{**good[0], "images": ["imgs/img0.png", "imgs/img1.png"]}], "fewer image placeholders"),
        "remote": ([chat_parts(0, "https://example.com/a.png")], "only local image files"),
        "pairs": ([{"images": ["imgs/img0.png"], "prompt": "<image>hi", "chosen": "a", "rejected": "b"}],
                  "add a preference: section"),  # pairs with images train with one (tests/vision/test_vision_dpo.py)
        "lora_trained_tower": (good, "train.vision: all: with lora"),
    }  # fmt: skip
    for name, (rows, says) in cases.items():
        r = run(rows, name, **({"vision": "all"} if name.startswith("lora") else {}))
        lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
        assert r.exit_code == 2 and len(lines) == 1 and says in lines[0], (name, r.output)
        assert not (tmp_path / f"run-{name}" / "checkpoints").exists()


def renamed_registry(root: Path, imgs: list[str]) -> Path:
    """LLaMA-Factory's dataset_info.json entry of the sharegpt form, its columns renamed."""
    rows = [{"pics": r["images"], "dialog": r["conversations"]} for r in forms(imgs)["sharegpt"]]
    write(root / "ren.jsonl", rows)
    entry = {
        "file_name": "ren.jsonl",
        "formatting": "sharegpt",
        "columns": {"messages": "dialog", "images": "pics"},
    }
    (root / "dataset_info.json").write_text(json.dumps({"ren": entry}))
    return root / "dataset_info.json"


def test_a_registrys_renamed_images_column_is_read(vlm, tmp_path):
    """`"images": "pics"` in a dataset_info.json entry: the same rows as the sharegpt form (the
    image check read the columns before the rename: the images were dropped, text trained)."""
    root, _ = vlm
    store = Store.open(root / "store")
    imgs = [f"imgs/{p.name}" for p in make_images(tmp_path / "data" / "imgs")]
    ts = prepared(store, renamed_registry(tmp_path / "data", imgs)).train
    want = prepared(store, write(tmp_path / "data" / "d.jsonl", forms(imgs)["sharegpt"])).train
    assert ts.stats["images"] == 4 and [list(ts[i].input_ids) for i in range(4)] == [
        list(want[i].input_ids) for i in range(4)
    ]


def test_image_record_for_a_text_only_model_refused(tiny_store, tmp_path):
    imgs = make_images(tmp_path / "data" / "imgs")
    data = write(tmp_path / "data" / "d.jsonl", forms([f"imgs/{p.name}" for p in imgs])["alpaca"])
    cfg = write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run", train={"steps": 1})
    r = horizon("train", cfg)
    assert r.exit_code == 2 and "record 1 names images" in r.output and "text only" in r.output, r.output
    reg = renamed_registry(tmp_path / "data", [f"imgs/{p.name}" for p in imgs])  # under a registry's names
    r = horizon(
        "train", write_config(tmp_path / "cfg.yaml", tiny_store, reg, tmp_path / "run", train={"steps": 1})
    )
    assert r.exit_code == 2 and "record 1 names images" in r.output and "text only" in r.output, r.output


CLASSES = {"mllama": "MllamaForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}  # fmt: skip


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_image_path_not_built_refused_naming_what_is_missing(tmp_path, family):
    import transformers

    from tests.support.census_config import tiny_config
    from tests.support.tokenizer import make_tokenizer

    cfg = tiny_config(family, 2)
    model = getattr(transformers, CLASSES[family])(cfg)
    model.save_pretrained(tmp_path / "hf")
    make_tokenizer(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    imgs = make_images(tmp_path / "data" / "imgs", n=1)
    data = write(tmp_path / "data" / "d.jsonl", [chat_parts(0, f"imgs/{imgs[0].name}")])
    cfg_path = write_config(
        tmp_path / "cfg.yaml", tmp_path / "store", data, tmp_path / "run", train={"steps": 1}
    )
    r = horizon("train", cfg_path)
    says = {  # Gemma 3 and Idefics3 / SmolVLM train with images: tests/vision/test_vision_families.py
        "mllama": "no get_image_features",
        "qwen3_vl": "image features inside its layers (deepstack)",
    }
    assert r.exit_code == 2 and says[family] in r.output and "trains on text only" in r.output, r.output


def test_trained_projector_checkpoint_resume_and_export(vlm, tmp_path):
    """train.vision: projector through the CLI: 4 steps equal 2 + a resume of 2, bit for bit; the
    export loads in transformers with the projector trained, the vision tower bitwise."""
    import transformers

    root, _ = vlm
    imgs = make_images(tmp_path / "data" / "imgs")
    data = write(tmp_path / "data" / "d.jsonl", forms([f"imgs/{p.name}" for p in imgs])["sharegpt"] * 2)

    def cfg(name: str, steps: int):
        return write_config(
            tmp_path / f"{name}.yaml", root / "store", data, tmp_path / name,
            train={"steps": steps, "batch_size": 2, "micro_batch_size": 1, "vision": "projector"},
            schedule={"kind": "constant", "warmup_steps": 0}, output={"save_every": 2, "keep_last": 3},
        )  # fmt: skip

    assert horizon("train", cfg("whole", 4)).exit_code == 0
    assert horizon("train", cfg("parts", 2)).exit_code == 0
    r = horizon("train", cfg("parts", 4))
    assert r.exit_code == 0 and "resuming" in r.output, r.output
    for name in ("whole", "parts"):
        assert horizon("export", tmp_path / name, tmp_path / f"{name}-hf").exit_code == 0
    load = transformers.LlavaForConditionalGeneration.from_pretrained
    orig, whole, parts = (
        load(p).state_dict() for p in (root / "hf", tmp_path / "whole-hf", tmp_path / "parts-hf")
    )
    assert orig.keys() == whole.keys() == parts.keys()
    assert all(torch.equal(whole[k], parts[k]) for k in orig)
    proj = [k for k in orig if k.startswith(TOWER[1])]
    assert proj and all(not torch.equal(orig[k], whole[k]) for k in proj)
    assert all(torch.equal(orig[k], whole[k]) for k in orig if k.startswith(TOWER[0]))


def test_dry_run_counts_the_tower(vlm, tmp_path):
    root, _ = vlm
    imgs = make_images(tmp_path / "data" / "imgs")
    data = write(tmp_path / "data" / "d.jsonl", forms([f"imgs/{p.name}" for p in imgs])["alpaca"])
    sizes = {}
    for vision in ("frozen", "all"):
        cfg = write_config(
            tmp_path / "cfg.yaml",
            root / "store",
            data,
            tmp_path / "run",
            train={"steps": 1, "vision": vision},
        )
        r = horizon("train", cfg, "--dry-run", "--json", tmp_path / f"{vision}.json")
        assert r.exit_code == 0, r.output
        plan = json.loads((tmp_path / f"{vision}.json").read_text())
        sizes[vision] = plan["device"]
        tower = sum(p.numel() * 4 for n, p in tiny_llava_params(root).items())
        assert plan["device"]["vision tower"] == tower
        assert "16 image tokens an image" in r.output
        assert ("vision state" in plan["host"]) == (vision == "all")
    assert sizes["all"]["vision activations"] > sizes["frozen"]["vision activations"] > 0


def tiny_llava_params(root: Path) -> dict:
    import transformers

    m = transformers.LlavaForConditionalGeneration.from_pretrained(root / "hf")
    return {n: p for n, p in m.named_parameters() if n.startswith(TOWER)}


def test_cache_keys_on_image_content(vlm, tmp_path):
    root, _ = vlm
    store = Store.open(root / "store")
    imgs = make_images(tmp_path / "data" / "imgs")
    data = write(tmp_path / "data" / "d.jsonl", forms([f"imgs/{p.name}" for p in imgs])["chat_parts"])

    def load():
        lines: list[str] = []
        cfg = DataConfig(path=str(data), max_seq_len=128, cache_dir=str(tmp_path / "cache"))
        ts = prepare_data(
            cfg, None, vocab_size=store.arch.vocab, log=lines.append, images=image_data(store)
        ).train
        return ts, any("cache hit" in ln for ln in lines)

    first, hit0 = load()
    again, hit1 = load()
    assert not hit0 and hit1
    for i in range(4):
        assert list(first[i].input_ids) == list(again[i].input_ids)
        assert (first[i].media["pixel_values"] == again[i].media["pixel_values"]).all()
    Image.new("RGB", Image.open(imgs[2]).size, (9, 9, 9)).save(imgs[2])  # same name, other pixels
    changed, hit2 = load()
    assert not hit2
    assert not (changed[2].media["pixel_values"] == first[2].media["pixel_values"]).all()


def test_generate_with_images_equals_transformers_greedy(vlm, tmp_path):
    """`horizon generate` with image prompts (and a text one) in one left-padded batch: each
    completion equals transformers' own greedy generate on the processor's outputs."""
    from transformers import AutoProcessor

    root, _ = vlm
    imgs = make_images(tmp_path / "imgs")
    prompts = [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": f"imgs/{imgs[i].name}"},
                                                   {"type": "text", "text": f"what is {i}?"}]}]}
        for i in (0, 3)
    ] + [{"messages": [{"role": "user", "content": "hello there"}]}]  # fmt: skip
    pf = write(tmp_path / "prompts.jsonl", prompts)
    r = horizon(
        "generate", root / "store", "--prompts", pf, "--max-new-tokens", "6", "--output", tmp_path / "o.jsonl"
    )
    assert r.exit_code == 0, r.output
    got = [json.loads(line)["completion_ids"] for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    proc = AutoProcessor.from_pretrained(root / "hf")
    model = type(vlm[1]).from_pretrained(root / "hf").float().eval()
    sensitive: list[bool] = []
    for k, want in enumerate(got):
        msgs, pics = prompts[2]["messages"], None
        if k < 2:  # the processor's own form: a bare image part, the image given to the call
            i = (0, 3)[k]
            msgs = [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"what is {i}?"}]}
            ]
            pics = [Image.open(imgs[i]).convert("RGB")]
        text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        inputs = proc(text=[text], images=pics, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
        ref = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert want == ref[: len(want)] and len(want) >= 1, (k, want, ref)
        if pics is not None:  # the image decides the greedy ids here, so ids that ignored it would differ
            blind = {k: v for k, v in inputs.items() if k not in ("pixel_values", "image_sizes")}
            with torch.no_grad():
                out = model.generate(**blind, max_new_tokens=6, do_sample=False)
            sensitive.append(out[0, inputs["input_ids"].shape[1] :].tolist() != ref)
    assert any(sensitive), "the tiny model's greedy ids do not depend on the images: the check is blind"


def tiny_mistral3(tmp_path: Path):
    """A tiny random Mistral 3 (vocab 400, image token 399, 64-pixel images: 4 tokens an image of
    64x64) and its fp32 store."""
    import transformers

    from tests.support.census_config import tiny_config

    cfg = tiny_config("mistral3", 2)
    cfg.text_config.vocab_size, cfg.image_token_index, cfg.vision_config.image_size = 400, 399, 64
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    return model, Store.open(tmp_path / "store")


def test_mistral3_compute_matches_transformers(tmp_path):
    """Mistral 3 (Pixtral tower, patch merger, image_sizes) takes the same image path, chosen by
    its class: loss, every gradient and 3 AdamW steps with the projector trained against
    Mistral3ForConditionalGeneration given the same tensors. Its processor (PixtralProcessor)
    needs torchvision, so the pixels here are made directly, not by the processor."""
    from horizon_cli.data import MicroBatch

    model, store = tiny_mistral3(tmp_path)
    g = torch.Generator().manual_seed(1)

    def row(n_img: int, n: int) -> tuple[list[int], list[int]]:
        ids = [1, 7] + [399] * n_img + torch.randint(3, 390, (n,), generator=g).tolist()
        return ids, [IGNORE] * (2 + n_img) + ids[2 + n_img :]

    def micro(rows, sizes):  # sizes: (h, w) of each image of the rows, in order
        mb = MicroBatch.from_rows(rows, 0)
        pv = torch.randn(len(sizes), 3, 64, 64, generator=g)
        mb.media = {"pixel_values": pv, "image_sizes": torch.tensor(sizes)} if sizes else None
        return mb

    steps = [
        [micro([row(4, 9), row(2, 6)], [(64, 64), (48, 64)]), micro([row(0, 8), row(4, 5)], [(64, 64)])],
        [micro([row(2, 7), row(4, 9)], [(48, 64), (64, 64)]), micro([row(4, 6), row(0, 4)], [(64, 64)])],
        [micro([row(4, 5), row(2, 8)], [(64, 64), (64, 48)]), micro([row(2, 9), row(4, 7)], [(64, 48), (64, 64)])],
    ]  # fmt: skip
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith("model.vision_tower."))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=HP["lr"], betas=tuple(HP["betas"]), eps=HP["eps"], weight_decay=HP["weight_decay"]
    )
    eng = Engine(
        store, EngineConfig(device="cpu", dtype="float32", loss_chunk=16), OptimConfig(kernel="torch", **HP),
        stage=vision_stage(store, "projector"),
    )  # fmt: skip
    named = dict(model.named_parameters())

    def hf_loss(mbs) -> float:
        return hf_batch_loss(model, mbs, lambda mb: {"input_ids": mb.input_ids, **(mb.media or {})})

    try:
        for s, mbs in enumerate(steps):
            opt.zero_grad(set_to_none=True)
            ref = hf_loss(mbs)
            if s == 0:
                loss_sum, tokens, _ = eng.forward_backward(mbs)
                assert abs(loss_sum / tokens - ref) / ref < 1e-5
                assert_engine_grads(eng, named)
            res = eng.step(mbs, HP["lr"])
            torch.nn.utils.clip_grad_norm_(params, HP["grad_clip"])
            opt.step()
            assert abs(res.loss - ref) / ref < 1e-5, (s, res.loss, ref)
        eng.wait()
        assert_engine_weights(eng, named)
    finally:
        eng.close()


def test_mistral3_generate_with_an_image_equals_transformers_greedy(tmp_path):
    """Generation with Mistral 3 image prompts (image_sizes cropping one image) and a text one in
    one left-padded batch: every completion equals Mistral3ForConditionalGeneration's greedy
    generate on the same input ids, pixel_values and image_sizes (pixels made here, as above), and
    every step's logits (1e-5): the tiny model's greedy ids alone barely depend on the image."""
    from horizon_cli.generate.decoder import Decoder
    from horizon_cli.model.sample import Sampler

    model, store = tiny_mistral3(tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts, media = [], {}
    for k, sizes in enumerate(([(64, 64)], [], [(48, 64), (64, 64)])):  # 64x64: 4 tokens, 48x64: 2
        ids = [1, 7] + [399] * sum((h // 32) * (w // 32) for h, w in sizes)  # 16-pixel patches, merged 2x2
        prompts.append((k, ids + torch.randint(3, 390, (3 + 2 * k,), generator=g).tolist()))
        if sizes:
            media[k] = {"pixel_values": torch.randn(len(sizes), 3, 64, 64, generator=g),
                        "image_sizes": torch.tensor(sizes)}  # fmt: skip
    eng = Engine(store, EngineConfig(device="cpu", dtype="float32"), OptimConfig(), forward_only=True,
                 stage=vision_stage(store, "frozen"))  # fmt: skip
    seen: dict[int, list[torch.Tensor]] = {}

    class Recording(Sampler):  # greedy, keeping each prompt's logits of every sweep
        def pick(self, logits, rows):
            for r, i in enumerate(rows):
                seen.setdefault(i, []).append(logits[r].clone())
            return super().pick(logits, rows)

    try:
        got = Decoder(eng, Recording(), max_new_tokens=6, media=media).run(prompts)
    finally:
        eng.close()
    for (k, ids), c in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), **media.get(k, {}), max_new_tokens=6,
                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)  # fmt: skip
        assert c.ids == out.sequences[0, len(ids) :].tolist() and len(c.ids) == 6, (k, c.ids)
        assert len(seen[k]) == len(out.logits) == 6
        for step, (ours, theirs) in enumerate(zip(seen[k], out.logits, strict=True)):
            assert rel_err(ours, theirs[0]) < 1e-5, (k, step, rel_err(ours, theirs[0]))


def test_one_conversation_one_mask_on_the_text_and_the_vision_path(vlm, tmp_path):
    """The same conversation is labelled alike whether it is read as text (data.templates) or as a
    record of an image file (vision.encode, with or without an image): each assistant turn through
    the whitespace its template writes after the end-of-turn marker (`</s>\\n` here, ChatML's
    `<|im_end|>\\n`), as TRL's {% generation %} training templates and LLaMA-Factory's qwen
    `format_assistant` slot `{{content}}<|im_end|>\\n` label it."""
    from transformers import AutoTokenizer

    root, _ = vlm
    store = Store.open(root / "store")
    imgs = make_images(tmp_path / "data" / "imgs")
    talk = {"messages": [{"role": "user", "content": "what is 1?"}, {"role": "assistant", "content": "colour 1"},
                         {"role": "user", "content": "and 2?"}, {"role": "assistant", "content": "colour 2"}]}  # fmt: skip
    tok = AutoTokenizer.from_pretrained(root / "hf")
    cfg = DataConfig(path=str(write(tmp_path / "data" / "t.jsonl", [talk])), max_seq_len=128, shuffle=False)
    text = prepare_data(cfg, tok, vocab_size=store.arch.vocab, log=lambda s: None).train
    mixed = write(tmp_path / "data" / "v.jsonl", [chat_parts(0, f"imgs/{imgs[0].name}"), talk])
    vision = prepared(store, mixed, shuffle=False).train
    assert "images" in vision.stats and "images" not in text.stats  # the two paths
    assert list(text[0].input_ids) == list(vision[1].input_ids)
    assert list(text[0].labels) == list(vision[1].labels)
    lab = vision[1].labels
    runs, run = [], []
    for t in list(lab) + [IGNORE]:  # the labelled runs of tokens
        if t != IGNORE:
            run.append(int(t))
        elif run:
            runs, run = [*runs, tok.decode(run)], []
    assert runs == ["colour 1</s>\n", "colour 2</s>\n"]
    pic = vision[0].labels
    assert tok.decode([int(t) for t in pic if t != IGNORE]) == "colour 0 here</s>\n"
