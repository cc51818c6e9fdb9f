"""The vision tower in the memory plan: its weights (resident on the device in the compute dtype),
its trained state on the host (train.vision projector | all: fp32 master, two moments, gradient),
and its activation working set at `data.max_pixels` x `train.micro_batch_size`, measured on the
meta device (no memory): the processor's tensors for one image at the pixel budget (a square of
max_pixels), repeated per row of the micro-batch, through `get_image_features` under autograd with
a saved-tensor hook (what the backward keeps: trained modes) and forward hooks (the largest
module output alive at once: the frozen forward's working set, taken twice for input and output).
A tower that reads its image grid's values (Qwen2-VL's image_grid_thw) cannot run there: its
weights and trained state are counted, its activations are said to be not measured.

Added to every rung of the plan (device: "vision tower", "vision activations", "vision gradient
sums"; host: "vision state") for a multimodal store whose image path is built (vision.support), so `--dry-run` shows
them and the fit check counts them; a text-only run of such a store builds no tower and is
over-counted by them (a tower is small beside its language model).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..errors import InputError
from .support import image_owner, is_multimodal


def _media_at_budget(proc, max_pixels: int) -> dict[str, torch.Tensor]:
    from PIL import Image

    side = max(1, math.isqrt(max_pixels))
    out = proc.image_processor(images=[Image.new("RGB", (side, side))], return_tensors="pt")
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def measure(store, cfg, dtype: torch.dtype) -> dict[str, int] | None:
    """{"weights", "trained", "activations", "image_tokens"} bytes (tokens: per image), or None
    for a store without a built image path."""
    from ..arch.generic import stored_model
    from .encode import load_processor
    from .trained import trained_names

    if not is_multimodal(store.arch) or getattr(store, "hf_dir", None) is not None:
        return None
    where = f"model.path: {store.root}"
    model = stored_model(store.arch.generic, dtype)
    try:
        spec = image_owner(store.arch, where, model)
        proc = load_processor(Path(store.root) / "hf", where)
    except InputError:
        return None  # refused when images are trained (vision.run); text runs plan as ever
    owner = model.get_submodule(spec.owner) if spec.owner else model
    params = {f"{c}.{n}": p for c in spec.towers for n, p in owner.get_submodule(c).named_parameters()}
    weights = sum(p.numel() for p in params.values()) * torch.empty((), dtype=dtype).element_size()
    trained = [] if cfg.train.vision == "frozen" else trained_names(spec.towers, params, "", cfg.train.vision)
    for n, p in params.items():
        p.requires_grad_(n in trained)
    media = _media_at_budget(proc, cfg.data.max_pixels)
    rows = cfg.train.micro_batch_size
    kw = {k: v.repeat(rows, *([1] * (v.dim() - 1))).to("meta") for k, v in media.items()}
    if "pixel_values" in kw:
        kw["pixel_values"] = kw["pixel_values"].to(dtype)
    try:
        saved, largest = _run(owner, kw, bool(trained))
        acts, tokens = saved + 2 * largest, _tokens(owner, kw, rows)
    except (RuntimeError, NotImplementedError):  # a tower that reads its grid's values (Qwen2-VL's
        acts = tokens = -1  # image_grid_thw): the meta device holds none, so not measured
    return {
        "weights": weights,
        "trained": 16 * sum(params[n].numel() for n in trained),  # host: fp32 master, m, v, grad
        "grad_sums": 4 * sum(params[n].numel() for n in trained),  # device: fp32 sums of a step
        "activations": acts,  # -1: not measured
        "image_tokens": tokens,
    }


def _run(owner, kw: dict, grad: bool) -> tuple[int, int]:
    """(bytes the backward saves, the largest single module output) of one meta forward."""
    saved, largest = [0], [0]

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            saved[0] += t.numel() * t.element_size()
        return t

    def hook(_m, _a, out):
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                largest[0] = max(largest[0], t.numel() * t.element_size())

    handles = [m.register_forward_hook(hook) for m in owner.modules()]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.set_grad_enabled(grad):
            owner.get_image_features(**kw, return_dict=True)
    finally:
        for h in handles:
            h.remove()
    return saved[0], largest[0]


def _tokens(owner, kw: dict, rows: int) -> int:
    with torch.no_grad():
        out = owner.get_image_features(**kw, return_dict=True)
    feats = getattr(out, "pooler_output", out)
    parts = list(feats) if isinstance(feats, list | tuple) else [feats]
    return sum(f.numel() // f.shape[-1] for f in parts) // max(1, rows)


def add_to_plan(planned, store, dtype: torch.dtype) -> dict[str, int] | None:
    """The tower's bytes into every rung's plan (module doc); returns what was measured."""
    got = measure(store, planned.cfg, dtype)
    if got is None:
        return None
    for plan in planned.rungs.values():
        plan.device["vision tower"] = got["weights"]
        if got["activations"] >= 0:
            plan.device["vision activations"] = got["activations"]
        if got["trained"]:
            plan.host["vision state"] = got["trained"]
            plan.device["vision gradient sums"] = got["grad_sums"]
    return got


def describe(got: dict[str, int], cfg) -> str:
    from ..fmt import fmt_bytes

    if got["activations"] < 0:
        acts = "not measured (the tower reads its image grid's values, which the meta device does not hold)"
    else:
        acts = (
            f"{fmt_bytes(got['activations'])} at data.max_pixels {cfg.data.max_pixels} x micro-batch "
            f"{cfg.train.micro_batch_size} ({got['image_tokens']} image tokens an image)"
        )
    text = (
        f"vision: tower {fmt_bytes(got['weights'])} resident on the device; its activations {acts}; "
        f"train.vision {cfg.train.vision}"
    )
    if got["trained"]:
        text += f"; trained state {fmt_bytes(got['trained'])} on the host"
    return text
