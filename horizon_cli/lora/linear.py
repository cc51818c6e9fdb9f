"""LoRA arithmetic on the device: one decoder layer's adapters, applied to its linear outputs.

PEFT's Linear.forward: y = base(x) + lora_B(lora_A(dropout(x))) * scaling, with scaling = alpha / r
(alpha / sqrt(r) with use_rslora). Dropout masks come from a generator seeded by (seed, optimizer
step, layer, micro-batch, target), so the backward recompute draws the same masks as the forward:
the micro-batch (with a loop's call and a tile's first token: model.call.LayerCall.key) is the
key the adapters are bound to for one call (`at`), a value, never written after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.call import MaskKey
from .setup import LoraSetup
from .targets import Target


class LayerLora:
    """One decoder layer's adapters on the device, called on each adapted linear layer's output."""

    def __init__(
        self,
        ab: dict[str, tuple[torch.Tensor, torch.Tensor]],
        scaling: float,
        dropout: float = 0.0,
        seed: int | None = None,
        mb: MaskKey = 0,
    ) -> None:
        """ab: weight name -> (A (r, in), B (out, r)); seed None: no dropout (evaluation); mb: the
        key of the call these adapters compute for (`at`)."""
        self.ab, self.scaling, self.p, self.seed = ab, scaling, dropout, seed
        self.order = {name: k for k, name in enumerate(ab)}
        self.mb = mb  # the call's key (model.call.LayerCall.key): its masks' name

    def at(self, key: MaskKey) -> LayerLora:
        """The same adapters (the same tensors), their dropout masks those of the call `key`."""
        return LayerLora(self.ab, self.scaling, self.p, self.seed, key)

    def __call__(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pair = self.ab.get(name)
        if pair is None:
            return y
        a, b = pair
        return y + F.linear(F.linear(self._dropout(name, x), a), b) * self.scaling

    def _dropout(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if not self.p or self.seed is None:
            return x
        g = torch.Generator(device=x.device)
        g.manual_seed(hash((self.seed, self.mb, self.order[name])) & ((1 << 63) - 1))
        keep = torch.rand(x.shape, generator=g, device=x.device) >= self.p
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))

    @staticmethod
    def from_views(
        views: dict[str, torch.Tensor],
        targets: list[Target],
        scaling: float,
        dropout: float,
        seed: int | None,
    ) -> LayerLora:
        ab = {t.weight: (views[f"{t.weight}.lora_A"], views[f"{t.weight}.lora_B"]) for t in targets}
        return LayerLora(ab, scaling, dropout, seed)


def layer_lora(
    setup: LoraSetup,
    views: dict[str, torch.Tensor],
    names: list[str],
    i: int,
    step: int,
    train: bool,
    grad: bool,
) -> tuple[LayerLora, list[torch.Tensor]]:
    """Layer i's adapters on the device (views: unit lora.{i} as loaded, by tensor name; names:
    its tensors in layout order), with their autograd leaves in that order when `grad`; dropout
    only when `train` (seeded by the optimizer step)."""
    leaves: list[torch.Tensor] = []
    if grad:  # autograd.grad never fills .grad: leaves of their own, views of the loaded buffer
        views = {k: v.detach().requires_grad_(True) for k, v in views.items()}
        leaves = [views[n] for n in names]
    seed = step_seed(setup.seed, step, i) if train else None
    lora = LayerLora.from_views(
        views, setup.targets[i], scaling=setup.scale, dropout=setup.cfg.dropout, seed=seed
    )
    return lora, leaves


def step_seed(seed: int, step: int, layer: int) -> int:
    """A dropout seed per (run seed, optimizer step, layer): the same in forward and recompute."""
    return hash((seed, step, layer)) & ((1 << 62) - 1)
