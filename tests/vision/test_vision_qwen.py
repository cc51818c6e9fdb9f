"""Qwen2-VL and Qwen2.5-VL with images (horizon_cli/vision): a tiny random checkpoint of each, 4
small images made here and put through Qwen2VLImageProcessor (the slow one, with a small pixel
budget: the processor class itself needs torchvision, absent here). The tower (patch embedding,
Qwen2.5-VL's window attention, the merger) runs through transformers' get_image_features, the
multimodal rotary position ids (3 streams t/h/w) come from the model's own get_rope_index per
micro-batch and reach every streamed layer. Loss, every gradient and 3 AdamW steps (tower frozen,
the merger trained, all of it trained) equal Qwen2VLForConditionalGeneration's / Qwen2_5_VL's
called with the same tensors + torch AdamW (fp32, 1e-5), with text-only rows beside image rows."""

import pytest
import torch
from PIL import Image

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.convert import convert
from horizon_cli.data import IGNORE, MicroBatch
from horizon_cli.engine import Engine
from horizon_cli.generate.decoder import Decoder
from horizon_cli.model.sample import Sampler
from horizon_cli.store import Store
from horizon_cli.vision.run import vision_stage
from tests.support.oracle import engine_grads, engine_weights, hf_batch_loss, one_thread, rel_err  # noqa: F401 (autouse fixture)
from tests.support.vision import make_images, qwen_image_processor, tiny_qwen_vl

# eps 1e-6, not 1e-8: the embedding rows of rare tokens get gradients near 1e-8, where AdamW makes
# steps of a large part of lr out of the two sides' rounding noise (1e-4 apart on an AVX-512 BF16 EPYC
# without AMX at eps 1e-8, where the gradients themselves agree to 1e-5, checked below)
HP = dict(lr=2e-3, betas=[0.9, 0.95], eps=1e-6, weight_decay=0.1, grad_clip=0.5)
IMAGE, START, END = 399, 397, 398
MERGE = 4  # 2 x 2 patches per image token
KEY_BIAS = "self_attn.k_proj.bias"  # in the dims RoPE barely turns softmax is ~invariant to it


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = tiny_qwen_vl(root / "hf", request.param)
    convert(root / "hf", root / "store", dtype="float32")
    imgs = make_images(root / "imgs")
    out = qwen_image_processor()([Image.open(p).convert("RGB") for p in imgs], return_tensors="pt")
    grids = out["image_grid_thw"]
    sizes = [int(g.prod()) for g in grids]  # patches per image
    pv = list(torch.split(out["pixel_values"], sizes))
    return root, model, pv, list(grids)


def steps(pv, grids):
    """3 steps of 2 micro-batches: rows with 0, 1 or 2 images (of different grids), text-only rows
    beside image rows, rows of different lengths (right padding)."""
    g = torch.Generator().manual_seed(1)

    def row(images: list[int], n: int) -> tuple[list[int], list[int]]:
        ids = [1, 7]
        for k in images:
            ids += [START] + [IMAGE] * (int(grids[k].prod()) // MERGE) + [END]
        lead = len(ids)
        ids += torch.randint(3, 390, (n,), generator=g).tolist()
        return ids, [IGNORE] * lead + ids[lead:]

    def micro(rows):
        mb = MicroBatch.from_rows([row(k, n) for k, n in rows], 0)
        used = [k for k, _ in rows for k in k]
        if used:
            mb.media = {"pixel_values": torch.cat([pv[k] for k in used]),
                        "image_grid_thw": torch.stack([grids[k] for k in used])}  # fmt: skip
        return mb

    return [
        [micro([([0], 9), ([1, 2], 6)]), micro([([], 8), ([3], 5)])],
        [micro([([2], 7), ([], 9)]), micro([([], 6), ([], 4)])],
        [micro([([3, 0], 5), ([1], 8)]), micro([([2], 9), ([3], 7)])],
    ]


def hf_loss(model, mbs) -> float:
    """Summed CE over the global batch's label tokens / their count, backward; the processor's
    tensors as the model takes them (token types: 1 on the image tokens, as the processor sets)."""

    def inputs(mb: MicroBatch) -> dict:
        att = (torch.arange(mb.input_ids.shape[1])[None] < mb.lengths[:, None]).long()
        ids = mb.input_ids
        return dict(
            input_ids=ids, attention_mask=att, mm_token_type_ids=(ids == IMAGE).int(), **(mb.media or {})
        )

    return hf_batch_loss(model, mbs, inputs)


@pytest.mark.parametrize("vision", ["frozen", "projector", "all"])
def test_qwen_vl_loss_grads_adamw_match_transformers(qwen, vision):
    root, model0, pv, grids = qwen
    store = Store.open(root / "store")
    model = type(model0).from_pretrained(root / "hf").float()
    model.train(False)
    for n, p in model.named_parameters():
        p.requires_grad_(
            not n.startswith("model.visual.")
            or vision == "all"
            or (vision == "projector" and ".merger." in n)
        )
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
        for s, mbs in enumerate(steps(pv, grids)):
            opt.zero_grad(set_to_none=True)
            ref = hf_loss(model, mbs)
            if s == 0:
                loss_sum, tokens, _ = eng.forward_backward(mbs)
                assert abs(loss_sum / tokens - ref) / ref < 1e-5
                tower = eng.p.embedding.trained
                grads = {**engine_grads(eng), **(tower.grad if tower is not None else {})}
                assert set(grads) == {n for n, p in named.items() if p.requires_grad}
                assert vision == "frozen" or any(".merger." in n for n in grads)
                for name, gr in grads.items():
                    assert rel_err(gr, named[name].grad) < 1e-5, name
            res = eng.step(mbs, HP["lr"])
            torch.nn.utils.clip_grad_norm_(params, HP["grad_clip"])
            opt.step()
            assert abs(res.loss - ref) / ref < 1e-5, (s, res.loss, ref)
        eng.wait()
        ours = {**engine_weights(eng), **(tower.master if tower is not None else {})}
        for name, p in named.items():
            if not p.requires_grad:
                continue
            if name.endswith(KEY_BIAS):  # its near-zero gradient entries (checked above) make AdamW steps of
                # both sides' rounding noise: within a thousandth of one step of lr
                assert (ours[name] - p.detach()).abs().max() < 1e-3 * HP["lr"], name
            else:
                assert rel_err(ours[name], p.detach()) < 1e-5, name
    finally:
        eng.close()


def test_qwen_vl_positions_are_the_models_own(qwen):
    """The position ids every layer gets for a micro-batch with images are get_rope_index's
    (3, b, T), not the rows' 1-D ones: a row with an image has h/w streams that differ."""
    root, model0, pv, grids = qwen
    store = Store.open(root / "store")
    eng = Engine(store, EngineConfig(device="cpu", dtype="float32"), OptimConfig(kernel="torch", **HP),
                 stage=vision_stage(store, "frozen"))  # fmt: skip
    try:
        mb = steps(pv, grids)[0][0]
        ctx = eng.sweep.contexts([mb])[0]
        pos = eng.p.embedding.positioned(mb).position_ids
        att = (torch.arange(mb.input_ids.shape[1])[None] < mb.lengths[:, None]).long()
        want, _ = model0.model.get_rope_index(
            mb.input_ids, mm_token_type_ids=(mb.input_ids == IMAGE).int(),
            image_grid_thw=mb.media["image_grid_thw"], attention_mask=att,
        )  # fmt: skip
        assert pos.shape == (3, *mb.input_ids.shape) and torch.equal(pos, want)
        assert not torch.equal(pos[1], pos[2])
        assert torch.equal(ctx.pos, want)  # what the owner's forward, and so every layer, gets
    finally:
        eng.close()


class Recording(Sampler):
    """Greedy, keeping every sweep's logits per prompt (the oracle compares them, not only ids)."""

    def __init__(self):
        super().__init__()
        self.seen: dict[int, list[torch.Tensor]] = {}

    def pick(self, logits, rows):
        for r, i in enumerate(rows):
            self.seen.setdefault(i, []).append(logits[r].clone())
        return super().pick(logits, rows)


def test_qwen_vl_generate_with_images_equals_transformers_greedy(qwen):
    """Generation with image prompts and a text one in one left-padded batch: the prefill's
    positions are get_rope_index's, each later token's continue from its rope deltas; every
    completion and every step's logits (1e-5) equal transformers' own greedy generate on the
    same tensors."""
    root, model0, pv, grids = qwen
    store = Store.open(root / "store")
    g = torch.Generator().manual_seed(3)
    prompts, media = [], {}
    for k, images in enumerate(([0, 1], [], [1, 2, 3])):  # rope deltas -2, 0, -4
        ids = [1, 7]
        for i in images:
            ids += [START] + [IMAGE] * (int(grids[i].prod()) // MERGE) + [END]
        ids += torch.randint(3, 390, (3 + 2 * k,), generator=g).tolist()
        prompts.append((k, ids))
        if images:
            media[k] = {"pixel_values": torch.cat([pv[i] for i in images]),
                        "image_grid_thw": torch.stack([grids[i] for i in images])}  # fmt: skip
    eng = Engine(store, EngineConfig(device="cpu", dtype="float32"), OptimConfig(), forward_only=True,
                 stage=vision_stage(store, "frozen"))  # fmt: skip
    sampler = Recording()
    try:
        got = Decoder(eng, sampler, max_new_tokens=6, media=media).run(prompts)
    finally:
        eng.close()
    model = type(model0).from_pretrained(root / "hf").float().eval()
    for (k, ids), c in zip(prompts, got, strict=True):
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(input_ids=x, mm_token_type_ids=(x == IMAGE).int(), **media.get(k, {}),
                                 max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)  # fmt: skip
        assert c.ids == out.sequences[0, len(ids) :].tolist(), k
        assert len(sampler.seen[k]) == len(out.logits) == 6
        for step, (ours, theirs) in enumerate(zip(sampler.seen[k], out.logits, strict=True)):
            assert rel_err(ours, theirs[0]) < 1e-5, (k, step)


def test_qwen_vl_plan_counts_the_tower_and_its_activations(qwen, monkeypatch):
    """The memory plan (--dry-run) counts the tower's weights and the trained merger's state, and
    its activations: the tower reads image_grid_thw's values, which stay real in the meta forward
    (vision.plan; the figure against the CPU's peak: tests/vision/test_vision_plan.py)."""
    from types import SimpleNamespace

    from horizon_cli.vision import encode, plan

    root, model0, _, _ = qwen
    store = Store.open(root / "store")
    proc = SimpleNamespace(image_processor=qwen_image_processor())
    monkeypatch.setattr(encode, "load_processor", lambda *a: proc)  # Qwen2VLProcessor needs torchvision
    cfg = SimpleNamespace(
        train=SimpleNamespace(vision="projector", micro_batch_size=2),
        data=SimpleNamespace(max_pixels=56 * 56),
        lora=None,
    )
    got = plan.measure(store, cfg, torch.float32)
    visual = model0.model.visual
    assert got["weights"] == 4 * sum(p.numel() for p in visual.parameters())
    assert got["trained"] == 16 * sum(p.numel() for p in visual.merger.parameters())
    assert got["activations"] > 0 and got["image_tokens"] == 4  # 56 x 56: 4 x 4 patches, merged 2 x 2
    assert "not measured" not in plan.describe(got, cfg)
