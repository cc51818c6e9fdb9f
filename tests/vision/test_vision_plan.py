"""The plan's vision activations (vision.plan.activations, on the meta device) against the peak
measured on the CPU: transformers' own tower and projector with real weights run on the same
images, a dispatch mode here counting the bytes of the new storages its ops make while they live
(a view of an existing storage, a weight's included, is not new). LLaVA (CLIP), Qwen2-VL and
Qwen2.5-VL (whose towers read their image grid's values), frozen, with the projector or the whole
tower trained (the saved tensors alive to the end, as until the backward): the plan is within 20 %
of the peak, never under it frozen or with the projector trained; with the whole tower trained
LLaVA's falls 15 % under it (the meta device runs SDPA as its math ops, not a fused kernel)."""

from __future__ import annotations

import weakref

import pytest
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from horizon_cli.vision.plan import activations, on_meta
from horizon_cli.vision.tower import _params_on_meta
from tests.support.oracle import one_thread  # noqa: F401 (autouse fixture)
from tests.support.vision import qwen_image_processor, tiny_llava, tiny_processor, tiny_qwen_vl

PROJECTOR = ("multi_modal_projector", "merger")


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes the ops' new storages hold at once (CPU tensors: by data pointer)."""

    def __init__(self, existing):
        super().__init__()
        self.live = self.peak = 0
        self.ptrs = {t.untyped_storage().data_ptr() for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.data_ptr() in self.ptrs or st.nbytes() == 0:
                    continue
                self.ptrs.add(st.data_ptr())
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, st.data_ptr(), st.nbytes())
        return out

    def _free(self, ptr: int, n: int) -> None:
        self.ptrs.discard(ptr)
        self.live -= n


def model_and_media(family: str, tmp_path):
    if family == "llava":
        model, proc = tiny_llava(tmp_path / "hf"), tiny_processor().image_processor
    else:
        model, proc = tiny_qwen_vl(tmp_path / "hf", family), qwen_image_processor()
    media = proc(images=[Image.new("RGB", (56, 56))], return_tensors="pt")
    return model.float().eval(), {k: v for k, v in media.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("vision", ["frozen", "projector", "all"])
def test_planned_tower_activations_equal_the_cpu_peak(tmp_path, family, vision):
    model, media = model_and_media(family, tmp_path)
    with _params_on_meta():
        meta = type(model)(model.config).eval()
    trained = vision != "frozen"
    for m in (model, meta):
        for n, p in m.named_parameters():
            tower = not n.startswith(("model.language_model.", "lm_head."))
            p.requires_grad_(tower and (vision == "all" or any(k in n for k in PROJECTOR)))
    rows = 2  # images of a micro-batch
    planned = activations(meta.model, on_meta(media, rows, torch.float32), trained)
    kw = {k: v.repeat(rows, *([1] * (v.dim() - 1))) for k, v in media.items()}
    with (
        torch.set_grad_enabled(trained),
        LiveBytes([*model.parameters(), *model.buffers(), *kw.values()]) as lv,
    ):
        out = model.model.get_image_features(**kw, return_dict=True)
    assert out is not None and lv.peak > 0
    # never under the measured peak frozen or with the projector trained, and near it (Qwen: within
    # 0.1 %, LLaVA 13 % over); with the whole tower trained the meta forward's SDPA runs as its math
    # ops, whose timeline is not the CPU's fused kernel's: LLaVA's plan falls 15 % under the peak
    low = 0.8 if vision == "all" else 0.999
    assert low * lv.peak <= planned <= 1.2 * lv.peak, (planned, lv.peak)


def test_generation_plan_counts_the_tower(tmp_path):
    """`horizon generate` with image prompts: the plan's rows hold the tower's weights and the
    prefill's tower activations for the batch's images (against the CPU peak, as above)."""
    import json

    from horizon_cli.convert import convert
    from horizon_cli.store import Store
    from horizon_cli.vision.plan import generation_bytes
    from tests.conftest import horizon
    from tests.support.vision import make_images

    model, _ = model_and_media("llava", tmp_path)
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    proc = tiny_processor()
    imgs = make_images(tmp_path / "imgs", n=2)
    media = [{k: v for k, v in proc(text=["<image>"], images=[Image.open(p).convert("RGB")], return_tensors="pt").items()
              if k == "pixel_values"} for p in imgs]  # fmt: skip
    got = generation_bytes(Store.open(tmp_path / "store"), media, torch.float32)
    tower = [
        p
        for n, p in model.named_parameters()
        if n.startswith(("model.vision_tower.", "model.multi_modal_projector."))
    ]
    assert got["vision tower"] == 4 * sum(p.numel() for p in tower)
    pv = torch.cat([m["pixel_values"] for m in media])
    with torch.no_grad(), LiveBytes([*model.parameters(), *model.buffers(), pv]) as lv:
        model.model.get_image_features(pixel_values=pv, return_dict=True)
    assert lv.peak * 0.999 <= got["vision activations (prefill)"] <= 1.2 * lv.peak
    prompts = tmp_path / "prompts.jsonl"
    part = {
        "role": "user",
        "content": [{"type": "image", "image": f"imgs/{imgs[0].name}"}, {"type": "text", "text": "hi"}],
    }
    prompts.write_text(json.dumps({"messages": [part]}) + "\n")
    r = horizon("generate", tmp_path / "store", "--prompts", prompts, "--max-new-tokens", "2")
    assert r.exit_code == 0 and "vision tower" in r.output and "vision activations" in r.output, r.output
