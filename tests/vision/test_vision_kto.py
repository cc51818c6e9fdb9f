"""Unpaired preference (KTO) examples with images (vision.unpaired) on a tiny random LLaVA with its
processor and 4 small images made here, against TRL 1.16's KTOTrainer on the same records (PIL
images; its reference model a copy of the initial one, as TRL refuses precomputed reference
log-probs for vision data): horizon's rows and mismatched (KL) rows equal its
DataCollatorForVisionUnpairedPreference's for the TRL and LLaMA-Factory forms, both rows of an
example carrying the prompt's own pixels; the reference log-probs (images seen) equal transformers'
own model given the processor's pixels; the first step's loss, KL estimate, rewards and log-probs
and every gradient (tower frozen, projector trained) and the weights after 2 AdamW steps equal
KTOTrainer's compute_loss + torch AdamW, fp32 1e-5. Qwen2-VL (its processor needs torchvision,
absent here, so no KTOTrainer): the reference pass, the loss, stats and gradients equal KTO's
formula on transformers' own model given the same pixels and grids. The CLI trains KTO with images
and refuses in one line what TRL refuses (preference pairs with images), an image in a completion,
and a text-only store given KTO records with images."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from horizon_cli.config.schema import DataConfig, EngineConfig, OptimConfig, PreferenceConfig
from horizon_cli.convert import convert
from horizon_cli.data import prepare_data
from horizon_cli.data.pairs import PairSet
from horizon_cli.data.unpaired import collate_unpaired
from horizon_cli.engine import Engine
from horizon_cli.recipes.kto.loss import KTOObjective
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
from tests.vision.test_vision_dpo import HP, PROJECTOR, resident_logps, write

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

N = 8  # examples; example i shows image i % 4
GROUP = 4  # TRL's per_device_train_batch_size (its collator rotates the KL completions within it)
LABELS = [True, False, True, True, False, True, False, False]
PREF = dict(loss="kto", beta=0.2, desirable_weight=1.3, undesirable_weight=0.7)
TRL_NAMES = {"rewards_chosen": ("rewards/chosen", "count_chosen"), "rewards_rejected": ("rewards/rejected", "count_rejected"),
             "logps_chosen": ("logps/chosen", "count_chosen"), "logps_rejected": ("logps/rejected", "count_rejected")}  # fmt: skip


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    model = tiny_llava(root / "hf")
    convert(root / "hf", root / "store", dtype="float32")
    imgs = make_images(root / "data" / "imgs")
    return root, model, imgs


def said(i: int) -> str:
    return f"colour {i} here" + " and more" * (i % 3)  # lengths differ, so the rotation shows


def forms(imgs: list[Path]) -> dict[str, list[dict]]:
    """The same N examples in each form horizon reads with images."""
    name = [f"imgs/{imgs[i % 4].name}" for i in range(N)]
    return {
        "trl": [
            {"images": [name[i]],
             "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"what is {i}?"}]}],
             "completion": [{"role": "assistant", "content": [{"type": "text", "text": said(i)}]}],
             "label": LABELS[i]}
            for i in range(N)
        ],
        "sharegpt": [
            {"images": [name[i]], "kto_tag": LABELS[i],
             "conversations": [{"from": "human", "value": f"<image>what is {i}?"}, {"from": "gpt", "value": said(i)}]}
            for i in range(N)
        ],
        "alpaca": [
            {"images": [name[i]], "instruction": f"<image>what is {i}?", "input": "", "output": said(i),
             "kto_tag": LABELS[i]}
            for i in range(N)
        ],
    }  # fmt: skip


def examples_of(root: Path, form: str, imgs) -> PairSet:
    store = Store.open(root / "store")
    data = write(root / "data" / f"kto-{form}.jsonl", forms(imgs)[form])
    cfg = DataConfig(path=str(data), max_seq_len=128, format="unpaired")
    got = prepare_data(
        cfg, None, vocab_size=store.arch.vocab, log=lambda s: None, images=image_data(store), batch_size=GROUP
    )
    assert isinstance(got.train, PairSet) and got.train.format == "unpaired" and len(got.train) == N
    return got.train


def trl_trainer(root: Path, model, imgs, tmp: Path):
    """TRL's KTOTrainer on the processor and the TRL form's records (PIL images), its reference
    model a copy of the initial one; the vision tower frozen, as train.vision: projector."""
    from transformers import AutoProcessor

    ds, policy = trl_vision_inputs(model, imgs, forms(imgs)["trl"], ("prompt", "completion", "label"))
    args = trl.KTOConfig(
        output_dir=str(tmp / "trl"), report_to=[], use_cpu=True, bf16=False, max_length=128,
        per_device_train_batch_size=GROUP, beta=PREF["beta"], desirable_weight=PREF["desirable_weight"],
        undesirable_weight=PREF["undesirable_weight"],
    )  # fmt: skip
    proc = AutoProcessor.from_pretrained(root / "hf")
    tr = trl.KTOTrainer(
        model=policy,
        ref_model=copy.deepcopy(model).float(),
        args=args,
        train_dataset=ds,
        processing_class=proc,
    )
    return tr, policy


def batch_of(tr, idx):
    return tr.data_collator([tr.train_dataset[i] for i in idx])


@pytest.mark.parametrize("form", ["trl", "sharegpt", "alpaca"])
def test_rows_and_kl_rows_equal_trls_vision_collator(vlm, tmp_path, form):
    root, model, imgs = vlm
    ex = examples_of(root, form, imgs)
    assert ex.ts.stats["images"] == N and ex.ts.stats["image_tokens"] == 16 * N
    assert ex.ts.stats["desirable"] == LABELS
    tr, _ = trl_trainer(root, model, imgs, tmp_path)
    for a in range(0, N, GROUP):  # one collator batch = one rotation block
        b = batch_of(tr, range(a, a + GROUP))
        assert b["label"].tolist() == LABELS[a : a + GROUP]
        for j in range(GROUP):
            own, kl = ex.rows([a + j])
            for r, key in ((own, ""), (kl, "KL_")):
                real = b[f"{key}attention_mask"][j].bool()
                assert b[f"{key}input_ids"][j][real].tolist() == list(r.input_ids), (a + j, key)
                mask = b[f"{key}completion_mask"][j][real].bool().tolist()
                assert mask == (torch.tensor(r.labels) != -100).tolist(), (a + j, key)
                # both rows carry the example's own prompt pixels (TRL forwards the KL rows with them)
                assert torch.equal(torch.as_tensor(r.media["pixel_values"]), b["pixel_values"][j : j + 1])
        assert not torch.equal(b["KL_input_ids"], b["input_ids"])  # the rotation happened


def engine(store) -> Engine:
    return Engine(
        store, EngineConfig(device="cpu", dtype="float32", loss_chunk=16), OptimConfig(kernel="torch", **HP),
        stage=vision_stage(store, "projector"), objective=KTOObjective(PreferenceConfig(**PREF)),
    )  # fmt: skip


def test_kto_with_images_equals_trl(vlm, tmp_path):
    root, model, imgs = vlm
    store = Store.open(root / "store")
    ex = examples_of(root, "trl", imgs)
    eng = engine(store)
    tr, policy = trl_trainer(root, model, imgs, tmp_path)
    policy.train(False)  # no dropout in the tiny model; eval mode as the engine computes
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=HP["lr"], betas=tuple(HP["betas"]), eps=HP["eps"], weight_decay=HP["weight_decay"]
    )
    named = dict(policy.named_parameters())
    try:
        every = collate_unpaired(ex.rows(range(N)), LABELS, 2, 0)
        ref = torch.cat(eng.sequence_logps(every))  # the reference pass, with the images
        assert rel_err(ref, resident_logps(model.float(), every)) < 1e-5
        text_only = [type(mb)(mb.input_ids, mb.labels, mb.position_ids, lengths=mb.lengths) for mb in every]
        assert rel_err(torch.cat(eng.sequence_logps(text_only)), ref) > 1e-3  # the images matter
        ref = ref.reshape(-1, 2).numpy()
        for s, idx in enumerate([list(range(GROUP)), list(range(GROUP, N))]):
            mbs = collate_unpaired(ex.rows(idx), [LABELS[i] for i in idx], 2, 0, ref[idx])  # 2 micro-batches
            opt.zero_grad(set_to_none=True)
            tr._metrics["eval"].clear()  # TRL's mode: "eval" (the policy is not in train mode)
            loss = tr.compute_loss(policy, batch_of(tr, idx))
            metrics = {k: v[-1] for k, v in tr._metrics["eval"].items()}
            loss.backward()
            _, _, stats = eng.evaluate(mbs)  # the logged stats, before the update
            assert stats["kl"] / GROUP == pytest.approx(metrics["kl"], rel=1e-5, abs=1e-7), s
            for ours, (theirs, count) in TRL_NAMES.items():
                assert stats[ours] / stats[count] == pytest.approx(metrics[theirs], rel=1e-5, abs=1e-7), (
                    s,
                    ours,
                )
            if s == 1:  # the policy has moved from the reference: a KL estimate and rewards away from 0
                assert (
                    metrics["kl"] > 1e-4
                    and abs(metrics["rewards/chosen"] - metrics["rewards/rejected"]) > 1e-4
                )
            if s == 0:  # the loss and every gradient of the first step
                got, div, _ = eng.forward_backward(mbs, eng.objective.divisor(mbs))
                assert div == GROUP and got / div == pytest.approx(loss.item(), rel=1e-5)
                assert_engine_grads(eng, named, PROJECTOR)
            res = eng.step(mbs, HP["lr"], eng.objective.divisor(mbs))
            torch.nn.utils.clip_grad_norm_(params, HP["grad_clip"])
            opt.step()
            assert res.loss == pytest.approx(loss.item(), rel=1e-5), s
        eng.wait()
        assert_engine_weights(eng, named)
    finally:
        eng.close()


def _run(root: Path, tmp_path: Path, rows: list[dict], name: str, store: Path | None = None):
    if not (tmp_path / "data" / "imgs").exists():
        (tmp_path / "data").mkdir(exist_ok=True)
        (tmp_path / "data" / "imgs").symlink_to(root / "data" / "imgs")
    cfg = write_config(
        tmp_path / f"{name}.yaml", store or root / "store", write(tmp_path / "data" / f"{name}.jsonl", rows),
        tmp_path / f"run-{name}", train={"steps": 2, "batch_size": GROUP, "micro_batch_size": 2, "vision": "projector"},
        preference=PREF, data={"max_seq_len": 128},
    )  # fmt: skip
    r = horizon("train", cfg)
    return r, tmp_path / f"run-{name}"


def _one_error(r) -> str:
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    return lines[0]


def test_cli_trains_kto_with_images(vlm, tmp_path):
    root, model, imgs = vlm
    r, run = _run(root, tmp_path, forms(imgs)["sharegpt"], "good")
    assert r.exit_code == 0, r.output
    assert "8 images, 128 image tokens" in r.output and "4 desirable, 4 undesirable" in r.output, r.output
    ref = np.load(run / "reference" / "train.npy")  # (examples, 2): completion, mismatched; file order
    every = collate_unpaired(examples_of(root, "sharegpt", imgs).rows(range(N)), LABELS, 2, 0)
    assert rel_err(torch.from_numpy(ref).reshape(-1), resident_logps(model.float(), every)) < 1e-5
    logged = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in logged if "kl" in m and m.get("step")]
    assert len(steps) == 2 and all(m["kl"] is not None for m in steps), logged


def test_cli_refuses_pairs_with_images_for_kto_and_an_image_in_a_completion(vlm, tmp_path, tiny_store):
    root, _, imgs = vlm
    pairs = [
        {
            "images": [f"imgs/{imgs[i % 4].name}"],
            "prompt": f"<image>what is {i}?",
            "chosen": "a",
            "rejected": "b",
        }
        for i in range(N)
    ]
    r, run = _run(root, tmp_path, pairs, "pairs")
    assert "not chosen/rejected pairs" in _one_error(r) and not run.exists()
    bad = copy.deepcopy(forms(imgs)["sharegpt"])
    bad[2]["conversations"][1]["value"] = "<image>look"
    r, run = _run(root, tmp_path, bad, "bad")
    assert "record 3: completion: an image in a completion" in _one_error(r) and not run.exists()
    r, run = _run(root, tmp_path, forms(imgs)["trl"], "text-only", tiny_store)
    line = _one_error(r)
    assert "record 1 names images" in line and "takes text only" in line and not run.exists()


def qwen_examples(pv, grids):
    """4 KTO examples as Qwen2-VL's processor lays them out (images 0, 1, 2 and a text-only one),
    through horizon's rows: example_rows, then kto_rows with the image tensors."""
    from horizon_cli.data.tokset import MediaBuilder
    from horizon_cli.data.unpaired import Example, example_rows, kto_rows
    from horizon_cli.vision.imageset import ImageSet
    from tests.vision.test_vision_qwen import END, IMAGE, MERGE, START

    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(3, 390, (n,), generator=g).tolist()  # noqa: E731
    examples, media = [], MediaBuilder()
    for i in range(4):
        img = [START] + [IMAGE] * (int(grids[i].prod()) // MERGE) + [END] if i < 3 else []
        examples.append(Example(np.array([1, 7, *img, *rand(3 + i)]), np.array(rand(2 + 2 * i)), LABELS[i]))
        media.add({"pixel_values": pv[i].numpy(), "image_grid_thw": grids[i][None].numpy()} if i < 3 else {})
    ts = example_rows(examples, 256)
    arrays, offs = media.arrays()
    ex = ImageSet(ts.tokens, ts.labels, ts.offsets, None, "unpaired", ts.stats, None, arrays, offs)
    wrap = lambda t, m, o: ImageSet(t.tokens, t.labels, t.offsets, None, t.format, t.stats, None, m, o)  # noqa: E731
    return PairSet(kto_rows(ex, 256, 4, wrap))


def qwen_logps(model, mbs) -> torch.Tensor:
    """Each row's summed log-prob of its labelled tokens: transformers' Qwen2-VL given the pixels,
    the image grids, the attention mask and the image token types, as its processor's outputs."""
    from tests.vision.test_vision_qwen import IMAGE

    out = []
    for mb in mbs:
        ids = mb.input_ids
        att = (torch.arange(ids.shape[1])[None] < mb.lengths[:, None]).long()
        kw = dict(
            input_ids=ids, attention_mask=att, mm_token_type_ids=(ids == IMAGE).int(), **(mb.media or {})
        )
        lp = torch.log_softmax(model(**kw).logits.float()[:, :-1], -1)
        lab = mb.labels[:, 1:]
        out.append((lp.gather(-1, lab.clamp(min=0)[..., None]).squeeze(-1) * (lab != -100)).sum(1))
    return torch.cat(out)


def test_qwen2_vl_kto_with_images_equals_the_formula_on_transformers(tmp_path):
    """Qwen2-VL (no processor here: it needs torchvision, so no KTOTrainer run): horizon's
    reference pass, KTO loss, logged stats and every gradient (merger trained) equal KTO's formula
    (TRL's _compute_loss) on transformers' own model given the same pixels and grids, the
    mismatched rows with their prompt's images (multimodal rotary positions from them), fp32."""
    from tests.support.vision import qwen_image_processor, tiny_qwen_vl

    model = tiny_qwen_vl(tmp_path / "hf", "qwen2_vl").float()
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    store = Store.open(tmp_path / "store")
    imgs = make_images(tmp_path / "imgs")
    out = qwen_image_processor()([Image.open(p).convert("RGB") for p in imgs], return_tensors="pt")
    grids = list(out["image_grid_thw"])
    pv = list(torch.split(out["pixel_values"], [int(x.prod()) for x in grids]))
    ex = qwen_examples(pv, grids)
    assert torch.equal(torch.as_tensor(ex.rows([0])[1].media["pixel_values"]), pv[0])  # the KL row's
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith("model.visual.") or ".merger." in n)
    named = dict(model.named_parameters())
    eng = Engine(
        store, EngineConfig(device="cpu", dtype="float32", loss_chunk=16), OptimConfig(kernel="torch", **HP),
        stage=vision_stage(store, "projector"), objective=KTOObjective(PreferenceConfig(**PREF)),
    )  # fmt: skip
    try:
        mbs = collate_unpaired(ex.rows(range(4)), LABELS[:4], 2, 0)
        ref = torch.cat(eng.sequence_logps(mbs))
        with torch.no_grad():
            assert rel_err(ref, qwen_logps(model, mbs)) < 1e-5
        g = torch.Generator().manual_seed(5)  # a reference away from the policy: non-trivial KL, rewards
        ref = (ref + torch.randn(ref.shape, generator=g) * 3.0).reshape(-1, 2)
        ref[:, 1] -= 4.0  # the mismatched rows' reference below the policy: a KL estimate above its clamp
        mbs = collate_unpaired(ex.rows(range(4)), LABELS[:4], 2, 0, ref.numpy())
        got, div, _ = eng.forward_backward(mbs, eng.objective.divisor(mbs))
        _, _, stats = eng.evaluate(mbs)
        lp = qwen_logps(model, mbs).reshape(-1, 2)
        b, des = PREF["beta"], torch.tensor(LABELS[:4])
        kl = (lp[:, 1].detach() - ref[:, 1]).mean().clamp(min=0)
        r = lp[:, 0] - ref[:, 0]
        losses = torch.where(
            des,
            PREF["desirable_weight"] * (1 - torch.sigmoid(b * (r - kl))),
            PREF["undesirable_weight"] * (1 - torch.sigmoid(b * (kl - r))),
        )
        loss = losses.mean()
        loss.backward()
        assert kl > 1e-3 and div == 4 and got / div == pytest.approx(loss.item(), rel=1e-5)
        assert stats["kl"] / div == pytest.approx(kl.item(), rel=1e-5)
        rew = b * r.detach()
        assert stats["rewards_chosen"] / stats["count_chosen"] == pytest.approx(
            rew[des].mean().item(), rel=1e-5
        )
        assert stats["rewards_rejected"] / stats["count_rejected"] == pytest.approx(
            rew[~des].mean().item(), rel=1e-5
        )
        assert stats["logps_chosen"] / stats["count_chosen"] == pytest.approx(
            lp[des, 0].mean().item(), rel=1e-5
        )
        grads = {**engine_grads(eng), **eng.p.embedding.trained.grad}
        assert set(grads) == {n for n, p in named.items() if p.requires_grad}
        assert any(".merger." in n for n in grads)
        for name, gr in grads.items():
            assert rel_err(gr, named[name].grad) < 1e-5, name
    finally:
        eng.close()


def test_kto_records_with_images_under_another_format_refused(vlm):
    """An SFT run's data.format chat on KTO records with images: one line, not read without labels."""
    from horizon_cli.errors import InputError

    root, _, imgs = vlm
    store = Store.open(root / "store")
    data = write(root / "data" / "kto-chat.jsonl", forms(imgs)["sharegpt"])
    with pytest.raises(
        InputError, match="holds unpaired preference \\(KTO\\) examples .* with images; read them"
    ):
        prepare_data(
            DataConfig(path=str(data), max_seq_len=128, format="chat"), None, vocab_size=store.arch.vocab,
            log=lambda s: None, images=image_data(store),
        )  # fmt: skip
