"""PEFT adapter files, written and read without PEFT (it is not needed at run time).

    <dir>/adapter_config.json         peft_type "LORA", r, lora_alpha, target_modules, use_rslora, ...
    <dir>/adapter_model.safetensors   base_model.model.<module>.lora_A.weight (r, in)
                                      base_model.model.<module>.lora_B.weight (out, r)

as PEFT's save_pretrained writes them (the adapter name removed from the keys), so
`peft.PeftModel.from_pretrained(base, dir)`, transformers and servers that load PEFT adapters read
them. Reading is strict where PEFT is lenient (it loads with strict=False): every expected key
must be there with its shape, and no other key may be.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..errors import InputError
from ..fsutil import read_json
from .targets import ALL_LINEAR, Target

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def key(module: str, which: str) -> str:
    """which: "A" or "B"."""
    return f"{PREFIX}{module}.lora_{which}.weight"


def expected_shapes(targets: list[list[Target]], r: int) -> dict[str, tuple[int, int]]:
    out = {}
    for layer in targets:
        for t in layer:
            out[key(t.module, "A")] = (r, t.in_features)
            out[key(t.module, "B")] = (t.out_features, r)
    return out


def saved_targets(
    targets: list[str] | str, chosen: list[list[Target]], tower: list[Target] | None = None
) -> list[str] | str:
    """target_modules as written: the config's, with all-linear spelled out as the module names'
    last components (which match exactly the adapted layers: every linear layer in the decoder);
    tower: adapted layers outside the decoder (a projector's), named whole: appended to a list,
    or one more alternative of a regular expression (PEFT fullmatches a string)."""
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        targets = sorted({t.rel.rsplit(".", 1)[-1] for layer in chosen for t in layer})
    if not tower:
        return targets
    if isinstance(targets, str):
        return f"(?:{targets})|(?:{'|'.join(re.escape(t.module) for t in tower)})"
    return [*targets, *(t.module for t in tower)]


def write_adapter(
    dst: Path,
    tensors: dict[str, torch.Tensor],
    *,
    r: int,
    alpha: float,
    dropout: float,
    targets: list[str] | str,
    rslora: bool,
    base: str,
) -> None:
    """Write the two files into `dst` (an existing directory, e.g. a temp dir renamed later)."""
    from safetensors.torch import save_file

    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": targets,
        "use_rslora": rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (Path(dst) / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(Path(dst) / WEIGHTS), metadata={"format": "pt"}
    )


def read_config(src: Path, where: str = "lora.init") -> dict:
    src = Path(src)
    path = src / CONFIG
    if not path.is_file():
        raise InputError(f"{where}: {src} is not a PEFT adapter dir (no {CONFIG})")
    cfg = read_json(path)
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise InputError(
            f"{path}: peft_type is {cfg.get('peft_type') if isinstance(cfg, dict) else None!r}, not 'LORA'"
        )
    for k, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(k) == bad:
            raise InputError(f"{path}: {k} is set: not supported")
    for k in ("rank_pattern", "alpha_pattern"):
        if cfg.get(k):
            raise InputError(f"{path}: {k} is set (per-module ranks): not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise InputError(f"{path}: adapter biases are not supported (bias must be 'none')")
    if cfg.get("modules_to_save"):
        raise InputError(
            f"{path}: modules_to_save {cfg['modules_to_save']} (fully trained modules): not supported"
        )
    return cfg


def check_config(cfg: dict, path: Path, r: int, alpha: float, rslora: bool) -> None:
    """The adapter's rank and scaling must be the run's: its weights mean nothing under another."""
    got = (cfg.get("r"), float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora", False)))
    if got != (r, float(alpha), rslora):
        raise InputError(
            f"{Path(path) / CONFIG}: r {got[0]}, lora_alpha {got[1]:g}, use_rslora {got[2]} differ from the "
            f"config's lora.r {r}, lora.alpha {alpha:g}, lora.use_rslora {rslora}"
        )


def read_weights(src: Path, expected: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Every expected key with its shape, no other key (strict), as fp32."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(src) / WEIGHTS
    if not path.is_file():
        raise InputError(f"lora.init: {path} is missing (only safetensors adapters are read)")
    try:
        sd = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"{path}: not a readable safetensors file ({e})") from None
    missing = sorted(k for k in expected if k not in sd)
    extra = sorted(k for k in sd if k not in expected)
    if missing:
        raise InputError(
            f"{path}: tensor {missing[0]} is missing ({len(missing)} missing): the adapter does not cover lora.targets"
        )
    if extra:
        raise InputError(
            f"{path}: unexpected tensor {extra[0]} ({len(extra)} extra): not one of lora.targets' adapters"
        )
    for k, shape in expected.items():
        if tuple(sd[k].shape) != shape:
            raise InputError(f"{path}: tensor {k} has shape {tuple(sd[k].shape)}, expected {shape}")
        if not sd[k].is_floating_point() or not bool(torch.isfinite(sd[k]).all()):
            raise InputError(f"{path}: tensor {k} is not finite floating point")
    return {k: v.to(torch.float32) for k, v in sd.items()}
