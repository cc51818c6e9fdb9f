"""What `horizon generate SRC` runs: a store, or a run dir's newest intact checkpoint.

    store           its weights; engine defaults (compute in the store's dtype when it is fp32,
                    else bf16)
    run dir         its newest intact checkpoint (store.ckpt, as `horizon export` picks it)
                    with the engine settings the run was trained with; a full fine-tuning
                    checkpoint is a store itself, a LoRA checkpoint names its frozen base (checked
                    by fingerprint) and holds the adapters, applied as in training (an NF4 base is
                    dequantized on the device, layer by layer)

The tokenizer and the generation settings (EOS ids) come from the store's `hf/` files.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from ..arch.reward import not_a_policy, scorer_class
from ..config import Config, load_config
from ..config.schema import EngineConfig
from ..data.prompts import model_eos_ids
from ..errors import InputError
from ..export.export import resolve_source
from ..lora import peft
from ..lora.merge import base_store
from ..lora.setup import LoraSetup, lora_setup
from ..runtime.device import resolve_device
from ..runtime.dtype import resolve as resolve_dtype
from ..store import Store, ckpt
from ..store.manifest import MANIFEST
from ..vision.adapters import projector_targets

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class Source:
    store: Store  # the weights the engine streams (a LoRA run: its frozen base)
    engine: EngineConfig
    lora: LoraSetup | None = None  # a LoRA run's adapters (setup.init holds them)
    checkpoint: Path | None = None  # a run dir's checkpoint, or None for a store
    config: Config | None = None  # the run's config (run dirs)

    @property
    def hf(self) -> Path:
        return self.store.root / "hf"

    @property
    def has_tokenizer(self) -> bool:
        return any((self.hf / f).is_file() for f in TOKENIZER_FILES)

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.hf)) if self.has_tokenizer else None

    def eos_ids(self) -> list[int]:
        return model_eos_ids(self.hf)

    def describe(self) -> str:
        what = f"{self.checkpoint} (" + ("LoRA on " + str(self.store.root) if self.lora else "full") + ")"
        return what if self.checkpoint is not None else str(self.store.root)


def open_source(src: str | Path, engine: dict | None = None) -> Source:
    """SRC resolved (InputError naming what is wrong); `engine`: engine settings to override
    (the Python API's; e.g. device, link_gbps, kv_cache). On the CPU the compute dtype is fp32
    unless `engine` names one: the CPU's bf16 matrix products are many times slower than fp32 ones
    at decoding's few rows (docs/benchmarks.md, "Generation")."""
    src_ = _open(src, engine)
    if not (engine or {}).get("dtype") and resolve_device(src_.engine) == "cpu":
        src_.engine = replace(src_.engine, dtype="float32")
    src_.engine = resolve_dtype(src_.engine)  # engine.dtype: auto named: decided for the device
    return src_


def _open(src: str | Path, engine: dict | None) -> Source:
    path = Path(src)
    if (path / MANIFEST).is_file() and not (path / "checkpoints").is_dir():
        store = Store.open(path)
        not_a_policy(scorer_class(store.manifest.extra), str(path))
        ecfg = EngineConfig(dtype="float32" if store.manifest.dtype == "float32" else "bfloat16")
        return Source(store, _engine(ecfg, engine))
    ck = resolve_source(path)  # a run dir's newest intact checkpoint (or a checkpoint itself)
    cfg = _run_config(ck)
    ecfg = _engine(cfg.engine, engine)
    if not ckpt.is_lora(ck):
        return Source(Store.open(ck), ecfg, None, ck, cfg)
    store = base_store(ck)
    if cfg.lora is None:
        raise InputError(f"{ck}: a LoRA checkpoint whose config has no lora: section")
    tower = projector_targets(store.arch, cfg.train.vision, cfg.lora.dropout)  # the projector's adapters
    setup = lora_setup(cfg.lora, store.arch, cfg.train.seed, read_init=False, tower=tower)
    peft.read_config(ck / "adapter", where=str(ck))
    setup.init = peft.read_weights(ck / "adapter", setup.expected())
    return Source(store, ecfg, setup, ck, cfg)


def _run_config(ck: Path) -> Config:
    text = ckpt.read_config_text(ck)
    if text is None:
        raise InputError(f"{ck}: the checkpoint holds no config ({ckpt.CONFIG})")
    return load_config(None, base=yaml.safe_load(text) or {})


def _engine(ecfg: EngineConfig, over: dict | None) -> EngineConfig:
    if not over:
        return ecfg
    unknown = sorted(set(over) - set(EngineConfig.__dataclass_fields__))
    if unknown:
        raise InputError(f"engine.{unknown[0]}: not an engine setting")
    cfg = load_config(
        None,
        base={
            "model": {"path": "-"},
            "data": {"path": "-"},
            "output": {"dir": "-"},
            "engine": {**_as_dict(ecfg), **over},
        },
    )
    return replace(cfg.engine)


def _as_dict(ecfg: EngineConfig) -> dict:
    return {k: getattr(ecfg, k) for k in EngineConfig.__dataclass_fields__}
