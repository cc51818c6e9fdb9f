"""The vision tower in the memory plan: its weights (resident on the device in the compute dtype),
its trained state on the host (train.vision projector | all: fp32 master, two moments, gradient;
with lora, the projector's adapters'),
and its activation working set at `data.max_pixels` x `train.micro_batch_size`, measured on the
meta device (no memory): the processor's tensors for one image at the pixel budget (a square of
max_pixels), repeated per row of the micro-batch, through `get_image_features` (under autograd in
trained modes, whose saved tensors stay alive as until the backward): the peak of the bytes its
ops' new storages hold at once (a dispatch mode counts each output storage that no input holds
while it lives).
The processor's integer tensors (Qwen2-VL's image_grid_thw, image sizes) stay real, since a tower
reads their values (Qwen's rotary ids, window index and attention spans come from the grid):
whatever is computed from them meets the meta tensors on the meta device (`_MetaMix`). A tower
that still cannot run there has its weights and trained state counted and its activations said to
be not measured.

Added to every rung of the plan (device: "vision tower", "vision activations", "vision gradient
sums"; host: "vision state") for a multimodal store whose image path is built (vision.support), so `--dry-run` shows
them and the fit check counts them; a text-only run of such a store builds no tower and is
over-counted by them (a tower is small beside its language model).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import InputError
from .encode import stacked, unstacked
from .support import HFModule, generic_of, image_owner, is_multimodal

if TYPE_CHECKING:
    from ..config import Config
    from ..engine.build import Planned
    from ..store import Store
    from ..store.files import ModelFiles
    from .encode import Processor


def _media_at_budget(proc: Processor, max_pixels: int) -> dict[str, torch.Tensor]:
    from PIL import Image

    side = max(1, math.isqrt(max_pixels))
    out = proc.image_processor(images=[Image.new("RGB", (side, side))], return_tensors="pt")
    return unstacked({k: v for k, v in out.items() if isinstance(v, torch.Tensor)})  # the data's layout


def measure(store: ModelFiles, cfg: Config, dtype: torch.dtype) -> dict[str, int] | None:
    """{"weights", "trained", "activations", "image_tokens"} bytes (tokens: per image), or None
    for a store without a built image path."""
    from ..arch.generic import stored_model
    from .encode import load_processor
    from .trained import trained_names

    if not is_multimodal(store.arch) or getattr(store, "hf_dir", None) is not None:
        return None
    where = f"model.path: {store.root}"
    model = stored_model(generic_of(store.arch), dtype)
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
    rows = cfg.train.micro_batch_size
    kw = on_meta(_media_at_budget(proc, cfg.data.max_pixels), rows, dtype)
    try:
        acts, tokens = activations(owner, kw, bool(trained)), _tokens(owner, kw, rows)
    except (RuntimeError, NotImplementedError):  # a tower the meta device cannot run
        acts = tokens = -1  # not measured
    n_trained = sum(params[n].numel() for n in trained)
    if cfg.lora is not None and trained:  # LoRA adapters on the projector's linears (vision.adapters)
        mods = dict(owner.named_modules())
        n_trained = sum(
            cfg.lora.r * (m.in_features + m.out_features)
            for n in trained
            if n.endswith(".weight") and isinstance(m := mods.get(n[: -len(".weight")]), torch.nn.Linear)
        )
    return {
        "weights": weights,
        "trained": 16 * n_trained,  # host: fp32 master, m, v, grad
        "grad_sums": 4 * n_trained,  # device: fp32 sums of a step
        "activations": acts,  # -1: not measured
        "image_tokens": tokens,
    }


def generation_bytes(
    store: Store, media: list[dict[str, torch.Tensor]], dtype: torch.dtype
) -> dict[str, int]:
    """A generation's tower rows of the plan (generate.plan): its weights on the device and the
    activations of one frozen forward over `media` (each prompt's processor tensors; the images of
    the batch at once, an upper bound of any prefill micro-batch's)."""
    from ..arch.generic import stored_model

    model = stored_model(generic_of(store.arch), dtype)
    spec = image_owner(store.arch, f"model.path: {store.root}", model)
    owner = model.get_submodule(spec.owner) if spec.owner else model
    weights = sum(p.numel() for c in spec.towers for p in owner.get_submodule(c).parameters())
    names = sorted({k for m in media for k in m})
    kw = on_meta({k: torch.cat([m[k] for m in media if k in m]) for k in names}, 1, dtype)
    for p in owner.parameters():
        p.requires_grad_(False)
    out = {"vision tower": weights * torch.empty((), dtype=dtype).element_size()}
    with contextlib.suppress(RuntimeError, NotImplementedError):  # a meta-less tower: not measured
        out["vision activations (prefill)"] = activations(owner, kw, False)
    return out


def on_meta(media: dict[str, torch.Tensor], rows: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One image's processor tensors repeated for `rows` images: floating ones on the meta device
    in the compute dtype, integer ones (grids, sizes) real, as the tower reads their values."""
    out = {}
    for k, v in media.items():
        v = v.repeat(rows, *([1] * (v.dim() - 1)))
        out[k] = v.to("meta", dtype) if v.is_floating_point() else v
    return out


def activations(owner: HFModule, kw: dict, grad: bool) -> int:
    """The tower's activation bytes for the images of `kw` (on_meta): the peak of the bytes its
    ops' new storages hold at once in one forward (trained modes: the graph's saved tensors stay
    alive to the end, as until the backward)."""
    live = _MetaMix()
    with torch.set_grad_enabled(grad), live:
        out = owner.get_image_features(**stacked(kw), return_dict=True)
    del out
    return live.peak


class _MetaMix(TorchDispatchMode):
    """An op that meets a meta tensor runs on the meta device (real operands moved there); the
    bytes of the new storages the ops make (a view, or an output sharing its input's storage as
    _unsafe_view does, is not new) are counted while they live, and their peak kept."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.held: set[int] = set()

    def __torch_dispatch__(
        self, func: Callable[..., object], types: object, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        both = (args, kwargs or {})
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_flatten(both)[0]):
            both = tree_map(
                lambda t: t.to("meta") if isinstance(t, torch.Tensor) and not t.is_meta else t, both
            )
        seen = {t.untyped_storage()._cdata for t in tree_flatten(both)[0] if isinstance(t, torch.Tensor)}
        out = func(*both[0], **both[1])
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st._cdata in seen or st._cdata in self.held or st.nbytes() == 0:
                continue
            self.held.add(st._cdata)
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, st._cdata, st.nbytes())
        return out

    def _free(self, key: int, n: int) -> None:
        self.held.discard(key)
        self.live -= n


def _tokens(owner: HFModule, kw: dict, rows: int) -> int:
    with torch.no_grad(), _MetaMix():
        out = owner.get_image_features(**stacked(kw), return_dict=True)
    feats = getattr(out, "pooler_output", out)
    parts = list(feats) if isinstance(feats, list | tuple) else [feats]
    return sum(f.numel() // f.shape[-1] for f in parts) // max(1, rows)


def add_to_plan(planned: Planned, store: ModelFiles, dtype: torch.dtype) -> dict[str, int] | None:
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


def describe(got: dict[str, int], cfg: Config) -> str:
    from ..fmt import fmt_bytes

    if got["activations"] < 0:
        acts = "not measured (the tower does not run on the meta device)"
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
