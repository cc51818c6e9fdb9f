"""What a training run trains, as the run around the engine sees it (train/), decided once from
its LoRA setup (`tuning_for`): train/ asks this object, never whether the run is LoRA.

    FullTuning   every unit trained: a checkpoint holds the whole store (the streaming copies)
                 and every unit's optimizer state; a resume builds the engine on it
    LoraTuning   adapters on a frozen base: a checkpoint holds the adapters (a PEFT adapter with
                 their exact fp32 masters) and their AdamW moments, and names the base, on which
                 a resume builds the engine; the finished run exports the adapter alone

    source(ck, base)     the store the engine is built on
    fresh()              a start without a checkpoint (LoRA: read lora.init)
    state_buffers        the optimizer-state buffers a checkpoint holds per unit
    write(...)/read(...) the checkpoint's weights (train/checkpoint.py writes the rest)
    placement(ranks)     how the trained state lies over the ranks: whole on one process, the same
                         on every rank (LoRA's replicated adapters), or each rank its slices
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..arch import ArchSpec
from ..faults import phase
from ..fsutil import copy_tree
from ..lora import peft
from ..lora.setup import LoraSetup, load_init
from ..lora.state import AdapterState
from ..state.host import HostState
from ..store import Store, StoreWriter, ckpt
from ..store.manifest import DTYPE_NAMES
from .ranks import Placement, Ranks

STATE_BUFFERS = ("lo", "m", "v", "lo8", "qm", "qw", "sm", "sw")  # those a unit's state kinds have
LORA_BUFFERS = ("m", "v")  # the master is the adapter file's fp32 tensors


class FullTuning:
    lora: LoraSetup | None = None
    state_buffers = STATE_BUFFERS
    reference_on_base = False  # a preference run's reference policy: the initial weights
    note = ""  # a warning for the user

    def source(self, ck: Path | None, base: Store) -> Store:
        """A resume's weights are its checkpoint's store."""
        return Store.open(ck) if ck else base

    def fresh(self) -> None:
        pass

    def placement(self, ranks: Ranks) -> Placement:
        return ranks.sliced

    def describe(self, host: HostState) -> str:
        return ""

    def trainer_fields(self, base: Store) -> dict:
        return {"lora": False}

    def write(
        self, host: HostState, spec: ArchSpec, dtype: torch.dtype, tmp: Path, model_store: Store, step: int
    ) -> None:
        """The streaming copies as a store (and the model's HF files beside them)."""
        source = model_store.manifest.source or str(model_store.root)
        w = StoreWriter(tmp, spec, DTYPE_NAMES[dtype], source=source)
        try:
            for name, st in host.units.items():
                w.write_unit(name, st.stream)
            w.finish(extra={"step": step})
        finally:
            w.close()
        phase("checkpoint-store", step)
        if (model_store.root / "hf").is_dir():
            copy_tree(model_store.root / "hf", tmp / "hf")

    def read(self, host: HostState, ck: Path, sums: dict) -> None:
        pass  # the engine was built on the checkpoint's store

    def finish(self, ck: Path, run_dir: Path) -> dict[str, str]:
        return {}


class LoraTuning:
    state_buffers = LORA_BUFFERS

    def __init__(self, setup: LoraSetup):
        self.lora = setup
        # fresh adapters (no lora.init): the initial policy is the base, the reference adapters off
        self.reference_on_base = not setup.cfg.init
        self.note = setup.note  # the adapter does not load whole into peft (lora.targets.peft_note)

    def source(self, ck: Path | None, base: Store) -> Store:
        """The base never changes: a resume builds on it and reads the adapters from `ck`."""
        return base

    def fresh(self) -> None:
        load_init(self.lora)  # a fresh start after all (every checkpoint damaged) needs lora.init

    def placement(self, ranks: Ranks) -> Placement:
        return ranks.replicated

    def describe(self, host: HostState) -> str:
        s = self.lora
        n = sum(st.layout.params for st in host.units.values())
        n += sum(s.r * (t.in_features + t.out_features) for t in s.tower)  # a projector's (vision.adapters)
        return f", LoRA r {s.r} on {sum(map(len, s.targets)) + len(s.tower)} linear layers ({n:,} parameters)"

    def trainer_fields(self, base: Store) -> dict:
        """The checkpoint holds no weights: name the frozen base."""
        return {"lora": True, "base": str(base.root.resolve())}

    def write(
        self, host: HostState, spec: ArchSpec, dtype: torch.dtype, tmp: Path, model_store: Store, step: int
    ) -> None:
        """The adapters as a PEFT adapter dir (fp32: the exact masters)."""
        assert isinstance(host, AdapterState)
        cfg = self.lora.cfg
        (tmp / "adapter").mkdir()
        peft.write_adapter(
            tmp / "adapter",
            host.tensors(),
            r=cfg.r,
            alpha=cfg.alpha,
            dropout=cfg.dropout,
            targets=peft.saved_targets(cfg.targets, self.lora.targets, self.lora.tower),
            rslora=cfg.use_rslora,
            base=model_store.manifest.source or str(model_store.root),
        )

    def read(self, host: HostState, ck: Path, sums: dict) -> None:
        """The masters from the adapter file, checked against its checksum."""
        assert isinstance(host, AdapterState)
        rel = f"adapter/{peft.WEIGHTS}"
        if rel not in sums or ckpt.crc_file(ck / rel) != sums[rel][1]:
            raise ckpt.CheckpointDamaged(f"{ck / rel}: missing or fails its checksum")
        host.set_tensors(peft.read_weights(ck / "adapter", self.lora.expected()))

    def finish(self, ck: Path, run_dir: Path) -> dict[str, str]:
        """The adapter alone, as PEFT files (small: always)."""
        from ..export import export

        export(ck, run_dir / "adapter", force=True, adapter=True)
        return {"adapter": str(run_dir / "adapter")}


Tuning = FullTuning | LoraTuning


def tuning_for(lora: LoraSetup | None) -> Tuning:
    return FullTuning() if lora is None else LoraTuning(lora)
