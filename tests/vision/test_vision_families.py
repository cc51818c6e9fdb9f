"""Gemma 3 and Idefics3 / SmolVLM with images (horizon_cli/vision): a tiny random checkpoint of each
with its processor built here (tests/support/vision_families), 4 small images made here.

Gemma 3's text layers attend bidirectionally within each image's block of tokens (its token
types), causal elsewhere, in its sliding-window and full layers alike (model.token_masks); its
embedding is scaled before the image features are merged. Idefics3 / SmolVLM split each image
into tiles (a per-row stack with its pixel mask) and merge through their own inputs_merger /
placeholder mask. For each: the processor's token ids equal horizon's; the loss, every gradient
and 3 AdamW steps (tower frozen, all of it trained) equal transformers' own model called with the
processor's outputs + torch AdamW (fp32, 1e-5), text-only rows beside image rows; generation with
an image equals transformers' greedy generate; the exported checkpoint loads in transformers; the
CLI trains, plans and refuses bad image input. SmolVLM (the same model as Idefics3 but for its merge:
get_placeholder_mask, LLaVA's path) and the CLI runs of the two Idefics-style classes are opt-in
(`-m slow`), to keep this file fast."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from horizon_cli.config.schema import DataConfig, EngineConfig, OptimConfig
from horizon_cli.convert import convert
from horizon_cli.data import collate, prepare_data
from horizon_cli.engine import Engine
from horizon_cli.export import export
from horizon_cli.store import Store
from horizon_cli.vision.run import image_data, vision_stage
from tests.conftest import horizon
from tests.support.oracle import engine_grads, engine_weights, hf_batch_loss, one_thread, rel_err  # noqa: F401 (autouse fixture)
from tests.support.vision import make_images
from tests.support.vision_families import tiny_vlm

HP = dict(lr=2e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, grad_clip=0.5)
KEY_BIAS = "self_attn.k_proj.bias"  # softmax is invariant to it: its gradient is rounding noise
LM = ("model.language_model.", "model.text_model.", "lm_head.")


# SmolVLM differs from Idefics3 by its merge only (get_placeholder_mask, LLaVA's path): opt-in (slow)
FAMILY_PARAMS = ["gemma3", "idefics3", pytest.param("smolvlm", marks=pytest.mark.slow)]


def build(root: Path, family: str):
    model, _ = tiny_vlm(root / "hf", family)
    convert(root / "hf", root / "store", dtype="float32")
    imgs = make_images(root / "data" / "imgs")
    return family, root, model, imgs


@pytest.fixture(scope="module", params=FAMILY_PARAMS)
def vlm(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp(request.param), request.param)


def chat(i: int, img: str | None) -> dict:
    user = [{"type": "image", "image": img}] if img else []
    return {"messages": [
        {"role": "user", "content": [*user, {"type": "text", "text": f"what is {i}?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": f"colour {i} here and there"}]},
    ]}  # fmt: skip


def dataset(root: Path, rows: list[dict]):
    path = root / "data" / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = Store.open(root / "store")
    cfg = DataConfig(path=str(path), max_seq_len=256)
    return store, prepare_data(
        cfg, None, vocab_size=store.arch.vocab, log=lambda s: None, images=image_data(store)
    ).train


def hf_inputs(model, mb) -> dict:
    """The processor's tensors as the model takes them: Idefics3's images one stack per row of
    the call (here the micro-batch's, in order), Gemma 3's token types 1 on its image tokens."""
    media = dict(mb.media or {})
    if "pixel_attention_mask" in media:
        media = {k: v[None] for k, v in media.items()}
    kw = {"input_ids": mb.input_ids, **media}
    if type(model).__name__.startswith("Gemma3"):
        kw["token_type_ids"] = (mb.input_ids == model.config.image_token_id).long()
    return kw


def test_processor_ids_equal_horizons(vlm):
    from transformers import AutoProcessor

    family, root, model, imgs = vlm
    _, ts = dataset(root, [chat(i, f"imgs/{imgs[i].name}") for i in range(4)])
    proc = AutoProcessor.from_pretrained(root / "hf")
    for i in range(4):
        msgs = chat(i, None)["messages"]
        msgs[0]["content"].insert(0, {"type": "image"})
        text = proc.apply_chat_template(msgs, tokenize=False)
        out = proc(text=[text], images=[Image.open(imgs[i]).convert("RGB")], add_special_tokens=False)
        assert list(ts[i].input_ids) == list(out["input_ids"][0]), (family, i)
        if "token_type_ids" in out:
            assert list(out["token_type_ids"][0]) == list(
                (ts[i].input_ids == model.config.image_token_id) * 1
            )
        pv = torch.as_tensor(np.asarray(out["pixel_values"]))
        assert torch.equal(torch.as_tensor(ts[i].media["pixel_values"]), pv[0] if pv.ndim == 5 else pv)


@pytest.mark.parametrize("vision", ["frozen", "all"])
def test_loss_grads_adamw_match_transformers(vlm, vision):
    family, root, model0, imgs = vlm
    rows = [chat(i, f"imgs/{imgs[i].name}") for i in range(4)] + [chat(9, None)]
    store, ts = dataset(root, rows + [chat(i, f"imgs/{imgs[(i + 1) % 4].name}") for i in range(3)])
    steps = [collate(ts.rows(r), 2, 0) for r in ([0, 1, 2, 4], [3, 5, 6, 7], [4, 7, 0, 5])]
    model = type(model0).from_pretrained(root / "hf").float()
    model.train(False)
    for n, p in model.named_parameters():
        p.requires_grad_(vision == "all" or n.startswith(LM))
    named = dict(model.named_parameters())
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
            opt.zero_grad(set_to_none=True)
            ref = hf_batch_loss(model, mbs, lambda mb: hf_inputs(model, mb))
            if s == 0:
                loss_sum, tokens, _ = eng.forward_backward(mbs)
                eng.t.synchronize()
                assert abs(loss_sum / tokens - ref) / ref < 1e-5
                tower = eng.p.embedding.trained
                grads = {**engine_grads(eng), **(tower.grad if tower is not None else {})}
                assert set(grads) == {n for n, p in named.items() if p.requires_grad}
                for name, g in grads.items():
                    ref_g = named[name].grad  # None: unused (Siglip's pooling head)
                    if ref_g is None:
                        assert not g.any(), name
                    elif name.endswith(KEY_BIAS):
                        assert g.abs().max() < 1e-5 and ref_g.abs().max() < 1e-5, name
                    else:
                        assert rel_err(g, ref_g) < 1e-5, (family, name)
            res = eng.step(mbs, HP["lr"])
            torch.nn.utils.clip_grad_norm_(params, HP["grad_clip"])
            opt.step()
            assert abs(res.loss - ref) / ref < 1e-5, (s, res.loss, ref)
        eng.wait()
        ours = {**engine_weights(eng), **(tower.master if tower is not None else {})}
        for name, p in named.items():
            if not p.requires_grad or name.endswith(KEY_BIAS):  # see test_vision.py
                continue
            # near-zero gradient entries (the tower's, ~1e-4 of the LM's here; an untied head's rows of
            # tokens never predicted): AdamW makes both sides' rounding noise there steps of lr size, so
            # those tensors are held to 3 thousandths of one step of lr instead
            near = (ours[name] - p.detach()).abs().max() < 3e-3 * HP["lr"]
            assert rel_err(ours[name], p.detach()) < 1e-5 or near, (family, name)
    finally:
        eng.close()


def test_generate_with_an_image_equals_transformers_greedy_and_export_loads(vlm, tmp_path):
    """`horizon generate` with image prompts and a text one in one left-padded batch: each completion
    equals transformers' greedy generate on the processor's outputs (Gemma 3: the image blocks'
    masks at the prefill only, as its generate passes token types); the store's export loads."""
    from transformers import AutoProcessor

    family, root, model0, imgs = vlm
    prompts = [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": str(imgs[i])},
                                                   {"type": "text", "text": f"what is {i}?"}]}]}
        for i in (1, 3)
    ] + [{"messages": [{"role": "user", "content": "hello there"}]}]  # fmt: skip
    pf = tmp_path / "prompts.jsonl"
    pf.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    r = horizon(
        "generate", root / "store", "--prompts", pf, "--max-new-tokens", "5", "--output", tmp_path / "o.jsonl"
    )
    assert r.exit_code == 0, r.output
    got = [json.loads(line)["completion_ids"] for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    proc = AutoProcessor.from_pretrained(root / "hf")
    export(root / "store", tmp_path / "out")
    model = type(model0).from_pretrained(tmp_path / "out").float().eval()  # the export, in transformers
    orig = model0.state_dict()
    assert all(torch.equal(v, orig[k]) for k, v in model.state_dict().items())
    for k, i in enumerate((1, 3, None)):  # one left-padded batch: images of 2 sizes and a text prompt
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"what is {i}?"}]}]
        pics = None if i is None else [Image.open(imgs[i]).convert("RGB")]
        msgs = prompts[2]["messages"] if i is None else msgs
        text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        inputs = proc(text=[text], images=pics, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
        ref = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert got[k] == ref[: len(got[k])] and len(got[k]) >= 1, (family, k, got[k], ref)


@pytest.mark.parametrize(
    "family", ["gemma3", *(pytest.param(f, marks=pytest.mark.slow) for f in ("idefics3", "smolvlm"))]
)
def test_cli_trains_plans_and_refuses_bad_image_input(family, tmp_path):
    """`horizon train` with the tower trained (its dry run plans the tower, a real run exports a
    checkpoint transformers loads with the tower changed); a record with more placeholders than
    images is one line, exit 2, nothing trained."""
    from tests.conftest import write_config

    family, root, model0, imgs = build(tmp_path / "m", family)
    rows = [chat(i, str(imgs[i])) for i in range(4)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(
        tmp_path / "cfg.yaml", root / "store", data, tmp_path / "run",
        data={"max_seq_len": 256}, train={"steps": 1, "batch_size": 2, "micro_batch_size": 1, "vision": "all"},
        output={"export": True},
    )  # fmt: skip
    r = horizon("train", cfg, "--dry-run")
    assert r.exit_code == 0 and "vision tower" in r.output, r.output
    r = horizon("train", cfg)
    assert r.exit_code == 0 and "done: 1 steps" in r.output, r.output
    after = type(model0).from_pretrained(tmp_path / "run" / "export").state_dict()
    orig = model0.state_dict()
    assert any(not torch.equal(orig[k], v) for k, v in after.items() if not k.startswith(LM))
    two = {"images": [str(imgs[0])], "conversations": [
        {"from": "human", "value": "<image><image>hi"}, {"from": "gpt", "value": "ok"}]}  # fmt: skip
    data.write_text(json.dumps(two) + "\n")
    r = horizon("train", cfg, "output.dir=" + str(tmp_path / "bad"))
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1 and "more image placeholders than images" in lines[0], (
        r.output
    )
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_processor_token_types_other_than_image_tokens_refused():
    """A processor whose token_type_ids mean more than the image tokens (PaliGemma's prefix) is
    refused at the data, naming it: the masks horizon builds read the image-token rule."""
    from horizon_cli.errors import InputError
    from horizon_cli.vision.encode import media_of

    ids = np.array([[1, 7, 9, 9, 5]])
    ok = {"input_ids": ids, "token_type_ids": (ids == 9) * 1, "pixel_values": np.zeros((1, 3, 4, 4))}
    assert set(media_of(ok, 9, "d.jsonl: record 1")) == {"pixel_values"}
    with pytest.raises(InputError, match="token_type_ids mark other tokens"):
        media_of({**ok, "token_type_ids": np.array([[0, 0, 0, 0, 1]])}, 9, "d.jsonl: record 1")
