"""LoRA adapters on a multimodal model's projector (`train.vision: projector` with `lora:`): the
language model gets its adapters as ever (lora/), the projector's linear layers get theirs here,
the vision encoder stays frozen (`train.vision: all` with `lora:` is refused).

    targets   projector_targets: the nn.Linear modules among the parameters train.vision: projector
              trains (vision.trained.trained_names), read off transformers' model on the meta
              device, as lora.targets.Target with layer -1 (LoraSetup.tower); PEFT's keys are the
              multimodal model's module names (base_model.model.model.multi_modal_projector.linear_1...)
    compute   a forward hook on each adapted module of the resident tower adds PEFT's term,
              y + B(A(x)) * scaling (lora.linear.LayerLora), so the owner's own get_image_features
              runs unchanged; A and B are the device copies (compute dtype) of fp32 host masters
    state     vision.trained.TowerState over the adapters (PEFT key -> tensor): fp32 masters and
              AdamW moments on the host, the step's gradient summed in fp32, the same CPU update
    files     a checkpoint writes the masters and moments as state files
              (state/vision.<PEFT key>.{master,m,v}.bin) and the adapters into the checkpoint's
              PEFT adapter file beside the language model's (adapter/adapter_model.safetensors;
              adapter_config.json's target_modules names them: lora.peft.saved_targets), so the
              adapter loads in peft on the multimodal model and the merged export merges them into
              the carried projector weights (export.carried)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import InputError
from ..lora import peft
from ..lora.linear import LayerLora
from ..lora.setup import LoraSetup
from ..lora.state import initial_adapters
from ..lora.targets import Target
from .support import generic_of, image_owner, is_multimodal
from .trained import TowerState, trained_names

if TYPE_CHECKING:
    from ..arch import ArchSpec
    from .tower import VisionTower

# a forward hook: (module, its positional inputs, its output) -> the output to use
Hook = Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]


def projector_targets(arch: ArchSpec, vision: str, dropout: float = 0.0) -> list[Target]:
    """The projector's linear layers a LoRA run adapts under train.vision (none when frozen or
    for a text-only model); InputError for train.vision: all, or a projector without one."""
    if vision == "frozen" or not is_multimodal(arch):
        return []
    if vision == "all":
        raise InputError(
            "train.vision: all: with lora the vision encoder is not adapted (only the projector is: "
            "train.vision: projector); set train.vision: projector or frozen"
        )
    if dropout:
        raise InputError(
            f"lora.dropout: {dropout:g} with train.vision: projector: the projector's adapters take no "
            "dropout yet; set lora.dropout: 0"
        )
    from ..arch.generic import stored_model

    model = stored_model(generic_of(arch))
    spec = image_owner(arch, "train.vision: projector", model)
    base = spec.owner + "." if spec.owner else ""
    names = set(trained_names(spec.towers, dict(model.named_parameters()), base, "projector"))
    out = [
        Target(-1, n, n, f"{n}.weight", m.in_features, m.out_features)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and f"{n}.weight" in names
    ]
    if not out:
        raise InputError(
            f"train.vision: projector: {spec.cls}'s projector has no linear layer to put LoRA adapters on; "
            "set train.vision: frozen (or train it fully without lora)"
        )
    return out


class ProjectorAdapters(TowerState):
    """The projector's adapters as the tower's trained state (module doc)."""

    def __init__(self, tower: VisionTower, setup: LoraSetup) -> None:
        init = initial_adapters(setup)  # PEFT key -> fp32 (lora.init's, or PEFT's default init)
        base = tower.spec.owner + "." if tower.spec.owner else ""
        params: dict[str, torch.nn.Parameter] = {}
        self.hooks = []
        for t in setup.tower:
            ka, kb = peft.key(t.module, "A"), peft.key(t.module, "B")
            for k in (ka, kb):
                params[k] = torch.nn.Parameter(init[k].to(tower.device, tower.dtype))
            lora = LayerLora({t.weight: (params[ka], params[kb])}, scaling=setup.scale)
            mod = tower.owner.get_submodule(t.module[len(base) :])
            self.hooks.append(mod.register_forward_hook(_hook(lora, t.weight)))
        super().__init__(params, list(params), {})
        self.master = {k: init[k].clone() for k in params}  # exact fp32, not the device copy's rounding

    def save(self, ck: Path) -> dict[str, int]:
        """Masters and moments as state files; the adapters into the checkpoint's PEFT file."""
        from safetensors.torch import load_file, save_file

        sums = self.save_state(ck)
        path = ck / "adapter" / peft.WEIGHTS
        tensors = {**load_file(str(path)), **{k: m.contiguous() for k, m in self.master.items()}}
        path.unlink()
        save_file(tensors, str(path), metadata={"format": "pt"})
        return sums


def _hook(lora: LayerLora, name: str) -> Hook:
    def add(
        mod: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> torch.Tensor:  # out (..., out_features) += B(A(x)) * scaling
        return lora(name, args[0], out)

    return add
