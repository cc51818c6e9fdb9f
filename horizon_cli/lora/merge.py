"""A LoRA run's checkpoint -> its adapter alone (PEFT files), or the base with the adapters merged.

The checkpoint names its frozen base (trainer.json: the store's path and fingerprint); the merged
weight of an adapted linear layer is PEFT's merge, W + (B @ A) * scaling, computed in fp32 from
the base tensor in the store's dtype (an NF4 base dequantized first) and written in that dtype.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

from ..errors import InputError
from ..store import Store, ckpt
from . import peft
from .targets import scale


def base_store(ck: Path) -> Store:
    """The frozen base a LoRA checkpoint was trained on, checked by fingerprint."""
    trainer = ckpt.read_trainer(ck)
    base = trainer.get("base")
    if not base:
        raise InputError(f"{ck}: a LoRA checkpoint that does not name its base store")
    store = Store.open(base)
    if ckpt.model_fingerprint(store) != trainer.get("model_fingerprint"):
        raise InputError(f"{ck}: its base store {base} has changed since training (fingerprint differs)")
    return store


class Merge:
    """fetch-time merging: HF name of a base tensor -> the tensor with its adapter merged."""

    def __init__(self, ck: Path):
        cfg = peft.read_config(ck / "adapter", where=str(ck))
        self.scaling = scale(float(cfg["lora_alpha"]), int(cfg["r"]), bool(cfg.get("use_rslora", False)))
        from safetensors.torch import load_file

        sd = load_file(str(ck / "adapter" / peft.WEIGHTS))
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for k in sd:
            if k.endswith(".lora_A.weight"):
                module = k[len(peft.PREFIX) : -len(".lora_A.weight")]
                self.pairs[module + ".weight"] = (sd[k].float(), sd[peft.key(module, "B")].float())

    def __call__(self, hf: str, w: torch.Tensor, inside=()) -> torch.Tensor:
        """The checkpoint tensor `hf` with the adapters of what it holds merged: itself, or the
        in-memory tensors inside it (`inside`: (name, element offset, shape), export's table)."""
        pair = self.pairs.get(hf)
        if pair is not None:
            return self._merged(w, pair)
        todo = [(off, shape, self.pairs[name]) for name, off, shape in inside if name in self.pairs]
        if not todo:
            return w
        flat = w.reshape(-1).clone()
        for off, shape, pair in todo:
            n = math.prod(shape)
            flat[off : off + n] = self._merged(flat[off : off + n].view(shape), pair).reshape(-1)
        return flat.view(w.shape)

    def _merged(self, w: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = pair
        return (w.float() + (b @ a) * self.scaling).to(w.dtype)

    def check(self, names: set[str]) -> None:
        stray = sorted(set(self.pairs) - names)
        if stray:
            raise InputError(f"adapter for {stray[0]}, which the base store does not hold")


def copy_adapter(ck: Path, tmp: Path) -> None:
    for f in (peft.CONFIG, peft.WEIGHTS):
        shutil.copyfile(ck / "adapter" / f, tmp / f)
