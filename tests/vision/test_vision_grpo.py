"""GRPO with images on a tiny random LLaVA and Qwen2-VL: the prompt's ids are TRL's (LLaVA: its
processor's apply_chat_template with the generation prompt, the image expanded into its image
tokens; Qwen2-VL: a stand-in for Qwen2VLProcessor, which needs torchvision, absent here), the
rollouts' prefill sees the pixels (greedy rollouts equal transformers' generate given them, and
differ without), no rollout samples the image token, and three optimizer steps equal TRL 1.16's
GRPO loss (its own `_compute_loss` on a stub trainer, as test_grpo_train; the policy's, the
rollout policy's and the reference's log-probs from transformers' model given the pixels, Qwen2-VL's
prompts left-padded to different lengths) + torch AdamW: the loss, the gradient norm, kl and the
clip ratio of every step, the tower frozen and the projector (merger) trained."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from horizon_cli.config.schema import RLConfig
from horizon_cli.convert import convert
from horizon_cli.recipes.grpo.advantages import advantages
from tests.conftest import write_config, write_jsonl
from tests.support.oracle import one_thread  # noqa: F401 (autouse fixture)
from tests.support.tokenizer import make_tokenizer
from tests.support.vision import (
    VISION_TEMPLATE,
    make_images,
    qwen_image_processor,
    tiny_llava,
    tiny_qwen_vl,
)
from tests.support.vision_families import tiny_vlm

trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from tests.rl.test_grpo_loss import trl_stub  # noqa: E402

G, B = 4, 2  # completions per prompt, prompts per step
REWARD = '''
def low_ids(completion_ids, **kw):
    """The share of a completion's tokens below 200."""
    return [sum(t < 200 for t in c) / len(c) for c in completion_ids]
'''
FAMILIES = {
    "llava": tiny_llava,
    "qwen2_vl": tiny_qwen_vl,
    "qwen2_5_vl": lambda root: tiny_qwen_vl(root, "qwen2_5_vl"),  # window attention in the tower
    "gemma3": lambda root: tiny_vlm(root, "gemma3")[0],  # token types: the image blocks' masks
    "idefics3": lambda root: tiny_vlm(root, "idefics3")[0],  # a per-row image stack and its mask
}
START, IMAGE, END = 397, 399, 398  # the tiny Qwen2-VL's vision start, image and end tokens


class QwenProcessor:
    """Qwen2VLProcessor's work on the tiny Qwen2-VL (the class needs torchvision, absent here): the
    chat template's `<image>` becomes <vision_start> + one image token per 2 x 2 patches of the
    image's grid + <vision_end>; the pixels are Qwen2VLImageProcessor's (testing.vision)."""

    def __init__(self):
        self.tokenizer = make_tokenizer(chat_template=VISION_TEMPLATE)
        self.image_processor = qwen_image_processor()
        self.chat_template, self.image_token_id = VISION_TEMPLATE, IMAGE

    def apply_chat_template(self, messages, **kw):
        return self.tokenizer.apply_chat_template(messages, **kw)

    def __call__(self, text, images, return_tensors="np", **kw):
        out = self.image_processor(images, return_tensors=return_tensors)
        pieces = text[0].split("<image>")
        ids = self.tokenizer(pieces[0], add_special_tokens=False)["input_ids"]
        for grid, piece in zip(out["image_grid_thw"], pieces[1:], strict=True):
            ids += [START] + [IMAGE] * (int(grid.prod()) // 4) + [END]
            ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        return {"input_ids": np.array([ids]), **out}


@pytest.fixture(scope="module", params=list(FAMILIES))
def vlm(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = FAMILIES[request.param](root / "hf")
    if request.param.startswith("qwen"):
        QwenProcessor().tokenizer.save_pretrained(root / "hf")
    convert(root / "hf", root / "store", dtype="float32")
    make_images(root / "data" / "imgs")
    return root, model.float().eval()


@pytest.fixture
def proc(vlm, monkeypatch):
    """The model's processor (Qwen2-VL's stand-in given to the run as its own: vision.encode)."""
    from transformers import AutoProcessor

    root, model = vlm
    if not type(model).__name__.startswith("Qwen2"):
        return AutoProcessor.from_pretrained(root / "hf")
    from horizon_cli.vision import encode

    p = QwenProcessor()
    monkeypatch.setattr(encode, "load_processor", lambda *a: p)
    return p


def records(n: int = 4) -> list[dict]:
    """Image i % 4 and "what is i?", told apart by their ids; LLaVA's prompts are all the same
    length (TRL left-pads prompts, and the positions it gives LLaVA's do not skip the padding)."""
    out = []
    for i in range(n):
        part = {"type": "image", "image": f"imgs/img{i % 4}.png"} if i % 2 else {"type": "image"}
        rec = {"prompt": [{"role": "user", "content": [part, {"type": "text", "text": f"what is {i}?"}]}]}
        out.append(rec if i % 2 else {"images": [f"imgs/img{i % 4}.png"], **rec})  # both forms
    return out


def run(root: Path, tmp_path: Path, rl: dict, steps: int) -> Path:
    from rich.console import Console

    from horizon_cli.train import run_training

    data = write_jsonl(root / "data" / f"{tmp_path.name}.jsonl", records())
    (tmp_path / "rw.py").write_text(REWARD)
    rl = {
        "num_generations": G,
        "max_completion_length": 6,
        "rewards": [{"function": f"{tmp_path / 'rw.py'}:low_ids"}],
        **rl,
    }
    cfg = write_config(tmp_path / "c.yaml", root / "store", data, tmp_path / "run", rl=rl,
                       data={"path": str(data), "max_seq_len": 128, "shuffle": True},
                       train={"steps": steps, "batch_size": B, "micro_batch_size": 3, "seed": 3, "vision": "projector"},
                       schedule={"kind": "constant", "warmup_steps": 0}, output={"save_every": 0})  # fmt: skip
    threads = torch.get_num_threads()
    try:
        run_training(cfg, [], console=Console(quiet=True))
    finally:
        torch.set_num_threads(threads)
    return tmp_path / "run"


def trl_prompt(root: Path, proc, i: int) -> dict:
    """TRL's GRPOTrainer._tokenize_prompts of one prompt: ids and the processor's image tensors."""
    image = Image.open(root / "data" / "imgs" / f"img{i % 4}.png").convert("RGB")
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": f"what is {i}?"}],
        }
    ]
    if isinstance(proc, QwenProcessor):
        text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        got = {k: torch.as_tensor(v) for k, v in proc([text], [image]).items()}
        return got | {"mm_token_type_ids": (got["input_ids"] == IMAGE).long()}
    got = proc.apply_chat_template(
        conversation=[msgs], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    return {k: v for k, v in got.items() if k != "attention_mask"}


def step_rows(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "rollouts" / f"step-{step}.jsonl").read_text().splitlines()]


def media_for(rs: list[dict], prompts: dict) -> dict:
    """Each completion row's prompt tensors, back to back (Idefics3's per-row image stacks padded
    with empty images to the longest, as its processor batches them), and TRL's num_images."""
    got = [prompts[tuple(r["prompt_ids"])] for r in rs]
    keys = [k for k in got[0] if k not in ("input_ids", "mm_token_type_ids", "token_type_ids")]
    out = {}
    for k in keys:
        vs = [g[k] for g in got]
        if vs[0].ndim >= 4 and k in ("pixel_values", "pixel_attention_mask"):
            n = max(v.shape[1] for v in vs)
            vs = [torch.cat([v, v.new_zeros(v.shape[0], n - v.shape[1], *v.shape[2:])], 1) for v in vs]
        out[k] = torch.cat(vs)
    return out | {"num_images": [1] * len(rs)}


def image_id(model) -> int:
    cfg = model.config
    return getattr(cfg, "image_token_id", None) or cfg.image_token_index


def prompts_of(root: Path, proc) -> dict:
    out = {}
    for i in range(4):
        p = trl_prompt(root, proc, i)
        out[tuple(p["input_ids"][0].tolist())] = p
    assert len(out) == 4  # told apart by their ids
    return out


def test_greedy_rollouts_see_the_image(vlm, proc, tmp_path):
    """top_k 1: each rollout is transformers' greedy generate given the pixels (and not the one
    without them), and its prompt ids are TRL's."""
    root, model = vlm
    prompts = prompts_of(root, proc)
    rs = step_rows(run(root, tmp_path, {"top_k": 1}, 1), 1)
    assert len(rs) == B * G and all(tuple(r["prompt_ids"]) in prompts for r in rs)
    for r in rs:
        p = prompts[tuple(r["prompt_ids"])]
        with torch.no_grad():
            # the image token suppressed, as rl.images masks it (Qwen2.5-VL's greedy picks it here)
            kw = dict(do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0,
                      suppress_tokens=[image_id(model)])  # fmt: skip
            want = model.generate(**p, **kw)
            blind = model.generate(input_ids=p["input_ids"], **kw)
        n = p["input_ids"].shape[1]
        assert r["completion_ids"] == want[0, n:].tolist()[: len(r["completion_ids"])]
        assert blind[0, n:].tolist() != want[0, n:].tolist()  # the image changes the answer


CASES = {"beta-mu1": dict(beta=0.04), "mu2-clipped": dict(loss_type="grpo", num_iterations=2, epsilon=0.05)}


@pytest.mark.parametrize("case", list(CASES))
def test_three_steps_equal_trl_loss_with_adamw(vlm, proc, tmp_path, case):
    from horizon_cli.train.metrics import read_metrics

    root, model = vlm
    rlkw = CASES[case]
    run_dir = run(root, tmp_path, rlkw, 3)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == 3
    cfg = RLConfig(max_completion_length=6, num_generations=G, **rlkw)
    prompts = prompts_of(root, proc)
    policy, ref = (
        copy.deepcopy(model).train(),
        copy.deepcopy(model),
    )  # train(): TRL logs "train" metrics (no dropout here)
    for n, p in policy.named_parameters():  # train.vision: projector: the tower frozen
        p.requires_grad_(not any(t in n for t in ("visual", "vision_tower", "vision_model")) or "merger" in n)
    add_fused_lm_head(policy, temperature=cfg.temperature, outputs=("log_probs", "entropy"))
    add_fused_lm_head(ref, temperature=cfg.temperature)
    stub = trl_stub(cfg, policy)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    old = None
    for k, row in enumerate(rows):
        g = k - k % cfg.num_iterations
        rs = step_rows(run_dir, g + 1)
        image = image_id(model)
        assert not any(image in r["completion_ids"] for r in rs)  # never sampled (rl.images)
        C = max(len(r["completion_ids"]) for r in rs)
        cid = torch.zeros(len(rs), C, dtype=torch.long)
        cmask = torch.zeros(len(rs), C, dtype=torch.long)
        for i, r in enumerate(rs):
            cid[i, : len(r["completion_ids"])] = torch.tensor(r["completion_ids"])
            cmask[i, : len(r["completion_ids"])] = 1
        P = max(len(r["prompt_ids"]) for r in rs)  # TRL left-pads prompts (Qwen2-VL's positions skip it)
        pid = torch.zeros(len(rs), P, dtype=torch.long)
        pmask = torch.zeros(len(rs), P, dtype=torch.long)
        for i, r in enumerate(rs):
            pid[i, P - len(r["prompt_ids"]) :] = torch.tensor(r["prompt_ids"])
            pmask[i, P - len(r["prompt_ids"]) :] = 1
        ids, am = torch.cat([pid, cid], 1), torch.cat([pmask, cmask], 1)
        adv, _, _ = advantages(torch.tensor([[r["rewards"]["low_ids"]] for r in rs]), torch.ones(1), G,
                               cfg.scale_rewards)  # fmt: skip
        media = media_for(rs, prompts)
        for key in ("mm_token_type_ids", "token_type_ids"):  # TRL: the prompt's, zeros on the completion
            if key in prompts[tuple(rs[0]["prompt_ids"])]:
                media[key] = (ids == image_id(model)).long() * am
        inputs = {"prompt_ids": pid, "prompt_mask": pmask, "completion_ids": cid,
                  "completion_mask": cmask, "advantages": adv, "num_items_in_batch": cmask.sum(), **media}  # fmt: skip
        with torch.no_grad():
            if cfg.num_iterations > 1 and k == g:  # the rollout policy: the weights that sampled them
                old, _, _ = stub._get_per_token_logps_and_entropies(policy, ids, am, C, **media)
            if cfg.num_iterations > 1:
                inputs["old_per_token_logps"] = old
            if cfg.beta > 0:
                inputs["ref_per_token_logps"], _, _ = stub._get_per_token_logps_and_entropies(
                    ref, ids, am, C, **media
                )
        opt.zero_grad()
        stub._metrics["train"].clear()
        loss = GRPOTrainer._compute_loss(stub, policy, inputs)
        loss.backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in policy.named_parameters()
                   if any(t in n for t in ("projector", "merger", "connector")))  # fmt: skip
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        metrics = {m: v[-1] for m, v in stub._metrics["train"].items()}
        assert row["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7), k
        # after an update, 1e-4: AdamW turns the fp32 rounding of a gradient element near zero into an
        # lr-sized update of either sign (m / sqrt(v)), as test_grpo_train says of its weights
        assert row["grad_norm"] == pytest.approx(norm.item(), rel=1e-5 if k == 0 else 1e-4), k
        if cfg.beta > 0:
            assert row["kl"] == pytest.approx(metrics["kl"], rel=1e-3, abs=1e-7), k
        if cfg.num_iterations > 1:
            assert row["clip_ratio/region_mean"] == pytest.approx(
                metrics["clip_ratio/region_mean"], abs=1e-6
            ), k
