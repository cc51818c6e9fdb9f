"""Preference pairs with images (vision.pairs) on a tiny random LLaVA with its processor and 4 small
images made here: horizon's rows equal TRL's DataCollatorForVisionPreference's for the TRL and
LLaMA-Factory forms; the reference log-probs (images seen) equal transformers' own model given the
processor's pixels; the DPO loss, every gradient (tower frozen, projector trained) and 3 AdamW steps
equal TRL's DPOTrainer (its reference model given the images too) + torch AdamW, fp32 1e-5; the
CLI trains DPO with images and refuses an image in a completion in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from horizon_cli.config.schema import DataConfig, EngineConfig, OptimConfig, PreferenceConfig
from horizon_cli.convert import convert
from horizon_cli.data import prepare_data
from horizon_cli.data.pairs import PairSet, collate_pairs
from horizon_cli.engine import Engine
from horizon_cli.recipes.preference.loss import PairObjective
from horizon_cli.store import Store
from horizon_cli.vision.run import image_data, vision_stage
from tests.conftest import horizon, write_config
from tests.support.oracle import engine_grads, engine_weights, one_thread, rel_err  # noqa: F401 (autouse fixture)
from tests.support.vision import (
    assert_engine_grads,
    assert_engine_weights,
    make_images,
    tiny_llava,
    trl_vision_inputs,
)

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

# eps 1e-4: DPO's gradients hold elements near 1e-8, where AdamW's g / (|g| + 1e-8) turns both sides'
# fp32 rounding (~1e-9) into updates that differ by a good part of lr (weights 4e-4 apart after one
# step with the gradients equal at 7e-7); at 1e-4 an element's update is smooth in its gradient
HP = dict(lr=2e-3, betas=[0.9, 0.95], eps=1e-4, weight_decay=0.1, grad_clip=0.5)
BETA = 0.2
N = 6  # pairs; pair i shows image i % 4
PROJECTOR = "model.multi_modal_projector."


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    model = tiny_llava(root / "hf")
    convert(root / "hf", root / "store", dtype="float32")
    imgs = make_images(root / "data" / "imgs")
    return root, model, imgs


def said(i: int) -> tuple[str, str]:
    return f"colour {i} here", f"no {i} at all {i % 3}"


def forms(imgs: list[Path]) -> dict[str, list[dict]]:
    """The same N pairs in each form horizon reads with images."""
    name = [f"imgs/{imgs[i % 4].name}" for i in range(N)]
    return {
        "trl": [
            {"images": [name[i]],
             "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"what is {i}?"}]}],
             "chosen": [{"role": "assistant", "content": [{"type": "text", "text": said(i)[0]}]}],
             "rejected": [{"role": "assistant", "content": said(i)[1]}]}
            for i in range(N)
        ],
        "sharegpt": [
            {"images": [name[i]], "conversations": [{"from": "human", "value": f"<image>what is {i}?"}],
             "chosen": {"from": "gpt", "value": said(i)[0]}, "rejected": {"from": "gpt", "value": said(i)[1]}}
            for i in range(N)
        ],
        "alpaca": [
            {"images": [name[i]], "instruction": f"<image>what is {i}?", "input": "",
             "chosen": said(i)[0], "rejected": said(i)[1]}
            for i in range(N)
        ],
    }  # fmt: skip


def write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pairs_of(root: Path, form: str, imgs) -> PairSet:
    store = Store.open(root / "store")
    data = write(root / "data" / f"{form}.jsonl", forms(imgs)[form])
    cfg = DataConfig(path=str(data), max_seq_len=128)
    got = prepare_data(cfg, None, vocab_size=store.arch.vocab, log=lambda s: None, images=image_data(store))
    assert isinstance(got.train, PairSet) and len(got.train) == N
    return got.train


def trl_trainer(root: Path, model, imgs, tmp: Path):
    """TRL's DPOTrainer on the processor and the TRL form's records (PIL images), its reference
    model a copy of the initial one; the vision tower frozen, as train.vision: projector."""
    from transformers import AutoProcessor

    ds, policy = trl_vision_inputs(model, imgs, forms(imgs)["trl"], ("prompt", "chosen", "rejected"))
    args = trl.DPOConfig(output_dir=str(tmp / "trl"), report_to=[], use_cpu=True, bf16=False, beta=BETA)
    proc = AutoProcessor.from_pretrained(root / "hf")
    tr = trl.DPOTrainer(
        model=policy,
        ref_model=copy.deepcopy(model).float(),
        args=args,
        train_dataset=ds,
        processing_class=proc,
    )
    return tr, policy


@pytest.mark.parametrize("form", ["trl", "sharegpt", "alpaca"])
def test_pair_rows_equal_trls_vision_collator(vlm, tmp_path, form):
    root, model, imgs = vlm
    pairs = pairs_of(root, form, imgs)
    tr, _ = trl_trainer(root, model, imgs, tmp_path)
    b = tr.data_collator([tr.train_dataset[i] for i in range(N)])  # chosen rows, then rejected rows
    rows = pairs.rows(range(N))
    assert pairs.stats["images"] == N and pairs.stats["image_tokens"] == 16 * N
    for i in range(N):
        for side in (0, 1):
            k, r = side * N + i, rows[2 * i + side]
            real = b["attention_mask"][k].bool()
            assert b["input_ids"][k][real].tolist() == list(r.input_ids), (i, side)
            assert b["completion_mask"][k][real].bool().tolist() == (torch.tensor(r.labels) != -100).tolist()
            assert torch.equal(torch.as_tensor(r.media["pixel_values"]), b["pixel_values"][i : i + 1])


def resident_logps(model, mbs) -> torch.Tensor:
    """Each row's summed log-prob of its labelled tokens: transformers' model given the pixels."""
    out = []
    with torch.no_grad():
        for mb in mbs:
            logits = model(input_ids=mb.input_ids, pixel_values=mb.media["pixel_values"]).logits.float()
            lp = torch.log_softmax(logits[:, :-1], -1)
            lab = mb.labels[:, 1:]
            out.append((lp.gather(-1, lab.clamp(min=0)[..., None]).squeeze(-1) * (lab != -100)).sum(1))
    return torch.cat(out)


def test_dpo_with_images_equals_trl(vlm, tmp_path):
    root, model, imgs = vlm
    store = Store.open(root / "store")
    pairs = pairs_of(root, "trl", imgs)
    eng = Engine(
        store, EngineConfig(device="cpu", dtype="float32", loss_chunk=16), OptimConfig(kernel="torch", **HP),
        stage=vision_stage(store, "projector"), objective=PairObjective(PreferenceConfig(loss="dpo", beta=BETA)),
    )  # fmt: skip
    tr, policy = trl_trainer(root, model, imgs, tmp_path)
    policy.train(False)  # no dropout in the tiny model; eval mode as the engine computes
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=HP["lr"], betas=tuple(HP["betas"]), eps=HP["eps"], weight_decay=HP["weight_decay"]
    )
    named = dict(policy.named_parameters())
    steps = [[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 0, 1]]
    try:
        every = collate_pairs(pairs.rows(range(N)), 2, 0)
        ref = torch.cat(eng.sequence_logps(every))  # the reference pass, with the images
        assert rel_err(ref, resident_logps(model.float(), every)) < 1e-5
        text_only = [type(mb)(mb.input_ids, mb.labels, mb.position_ids, lengths=mb.lengths) for mb in every]
        assert rel_err(torch.cat(eng.sequence_logps(text_only)), ref) > 1e-3  # the images matter
        ref = ref.reshape(-1, 2).numpy()
        for s, idx in enumerate(steps):
            mbs = collate_pairs(pairs.rows(idx), 2, 0, ref[idx])
            opt.zero_grad(set_to_none=True)
            loss = tr.compute_loss(policy, tr.data_collator([tr.train_dataset[i] for i in idx]))
            loss.backward()
            if s == 0:  # every gradient of the first step, before the update
                got, div, _ = eng.forward_backward(mbs, eng.objective.divisor(mbs))
                assert got / div == pytest.approx(loss.item(), rel=1e-5)
                assert_engine_grads(eng, named, PROJECTOR)
            res = eng.step(mbs, HP["lr"], eng.objective.divisor(mbs))
            torch.nn.utils.clip_grad_norm_(params, HP["grad_clip"])
            opt.step()
            assert res.loss == pytest.approx(loss.item(), rel=1e-5), s
        eng.wait()
        assert_engine_weights(eng, named)
    finally:
        eng.close()


def test_cli_trains_dpo_with_images_and_refuses_an_image_in_a_completion(vlm, tmp_path):
    root, model, imgs = vlm
    rows = forms(imgs)["sharegpt"]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "imgs").symlink_to(root / "data" / "imgs")

    def run(rows, name):
        cfg = write_config(
            tmp_path / f"{name}.yaml", root / "store", write(tmp_path / "data" / f"{name}.jsonl", rows),
            tmp_path / f"run-{name}", train={"steps": 1, "batch_size": 2, "micro_batch_size": 1, "vision": "projector"},
            preference={"loss": "dpo", "beta": BETA},
        )  # fmt: skip
        return horizon("train", cfg)

    r = run(rows, "good")
    assert r.exit_code == 0 and "6 images, 96 image tokens" in r.output, r.output
    ref = np.load(tmp_path / "run-good" / "reference" / "train.npy")  # (pairs, 2), file order
    every = collate_pairs(pairs_of(root, "sharegpt", imgs).rows(range(N)), 2, 0)
    assert rel_err(torch.from_numpy(ref).reshape(-1), resident_logps(model.float(), every)) < 1e-5
    bad = [{**rows[0], "chosen": {"from": "gpt", "value": "<image>look"}}]
    r = run(bad, "bad")
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1 and "chosen: an image in a completion" in lines[0], r.output
    assert not (tmp_path / "run-bad" / "checkpoints").exists()
