"""A run's LoRA settings resolved against its model: which linear layers get adapters, their
scale, and the adapters to start from (lora.init, read strictly), before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..arch import ArchSpec
from ..config.schema import LoraConfig
from ..errors import InputError
from ..store import ckpt
from . import peft
from .targets import Target, peft_note, resolve_targets, scale


@dataclass
class LoraSetup:
    """A run's LoRA settings, resolved against the model."""

    cfg: LoraConfig
    targets: list[list[Target]]  # per decoder layer (empty: no adapter in that layer)
    scale: float
    seed: int
    init: dict[str, torch.Tensor] | None = None  # PEFT key -> fp32, from lora.init
    note: str = ""  # a warning for the user: the adapter does not load whole into peft (targets.peft_note)
    # adapted linear layers outside the decoder stack (a multimodal model's projector with
    # train.vision: projector, vision.adapters): layer -1, weight = their in-memory parameter name
    tower: list[Target] = field(default_factory=list)

    @property
    def r(self) -> int:
        return self.cfg.r

    def expected(self) -> dict[str, tuple[int, int]]:
        return peft.expected_shapes([*self.targets, self.tower], self.cfg.r)


def lora_setup(
    cfg: LoraConfig, spec: ArchSpec, seed: int = 0, read_init: bool = True, tower: list[Target] | None = None
) -> LoraSetup:
    """Resolve lora.targets (InputError naming what is wrong) and read lora.init (strictly), unless
    read_init is False: a resume starts from its checkpoint's adapters and needs no lora.init.
    tower: the adapted linear layers outside the decoder stack (LoraSetup.tower)."""
    targets = resolve_targets(cfg.targets, spec)
    setup = LoraSetup(
        cfg,
        targets,
        scale(cfg.alpha, cfg.r, cfg.use_rslora),
        seed,
        note=peft_note(spec, targets),
        tower=list(tower or []),
    )
    if read_init:
        load_init(setup)
    return setup


def load_init(setup: LoraSetup) -> None:
    """setup.init from lora.init (when given), checked against the config and the targets."""
    cfg = setup.cfg
    if cfg.init and setup.init is None:
        init = Path(cfg.init)
        pcfg = peft.read_config(init)
        peft.check_config(pcfg, init, cfg.r, cfg.alpha, cfg.use_rslora)
        setup.init = peft.read_weights(init, setup.expected())


def lora_for(
    lora: LoraConfig | None,
    store,
    seed: int = 0,
    read_init: bool = True,
    run_dir: Path | None = None,
    tower: list[Target] | None = None,
) -> LoraSetup | None:
    """A run's lora section resolved against its store (None: full fine-tuning). A 4-bit store
    cannot be fully fine-tuned: without a lora section it is refused. run_dir: a training run's
    dir, whose intact checkpoint (a resume) makes `lora.init` unneeded, so it is not read."""
    if lora is None:
        if store.quant:
            raise InputError(
                f"model.path: {store.root} is a 4-bit ({store.quant}) store, which cannot be fully "
                "fine-tuned: add a lora: section (or convert without --quantize)"
            )
        return None
    if run_dir is not None and lora.init:
        read_init = read_init and not ckpt.intact(run_dir)[0]
    return lora_setup(lora, store.arch, seed, read_init, tower)


def check_same_kind(lora: LoraConfig | None, trainer: dict, run: Path, ck: Path) -> None:
    """A run dir resumes as the kind of run it holds: a LoRA checkpoint with a lora: section, a full
    fine-tuning one without (switching starts a new run)."""
    if bool(trainer.get("lora")) != (lora is not None):
        kind = "a LoRA" if trainer.get("lora") else "a full fine-tuning"
        raise InputError(
            f"lora: {run} holds {kind} checkpoint ({ck.name}); use another output.dir "
            "(switching between LoRA and full fine-tuning starts a new run)"
        )
