"""The merged export of a LoRA run whose adapters reach the carried tensors (a multimodal model's
projector, `train.vision: projector`, vision.adapters): the carried file rewritten with each
adapted weight merged (lora.merge: W + (B @ A) * scaling in fp32, in the tensor's own dtype), every
other tensor byte for byte.

The adapter's keys are the in-memory module names (peft's, on the multimodal model); the carried
file keeps the checkpoint's names, mapped to memory by transformers' own renamings (arch.disk),
as the tower's loader maps them (vision.tower)."""

from __future__ import annotations

from pathlib import Path

from ..arch.generic_arch import GenericArch
from ..lora.merge import Merge
from ..store import Store
from ..store.carried import FILE, SUM, carried_names, write_carried


def carried_memory_names(store: Store) -> dict[str, str]:
    """In-memory name -> carried (checkpoint) name of every tensor the store carries."""
    names = carried_names(store.root / "hf")
    if not names:
        return {}
    return store.arch.visit(lambda _: dict[str, str](), lambda g: _memory_names(g, names))


def _memory_names(g: GenericArch, names: list[str]) -> dict[str, str]:
    """The carried names mapped to memory by the model's own renamings (a native model carries none)."""
    from transformers.core_model_loading import rename_source_key

    from ..arch.disk import transforms
    from ..arch.generic import stored_model

    renamings, converters = transforms(stored_model(g))
    return {rename_source_key(k, renamings, converters)[0]: k for k in names}


def merge_carried(store: Store, merge: Merge, carried: dict[str, str], tmp: Path) -> bool:
    """Rewrite tmp's copy of the carried file with the adapters merged; False when none reaches it."""
    todo = {carried[m]: m for m in merge.pairs if m in carried}
    if not todo:
        return False
    from safetensors import safe_open

    with safe_open(str(store.root / "hf" / FILE), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (small: a tower)
    for disk, mem in todo.items():
        tensors[disk] = merge(mem, tensors[disk])
    (tmp / FILE).unlink(missing_ok=True)
    infos = [(k, tuple(t.shape), t.dtype, t.numel() * t.element_size()) for k, t in tensors.items()]
    write_carried(tmp, infos, ((k, [t.reshape(-1)]) for k, t in tensors.items()))
    (tmp / SUM).unlink()  # an export carries no checksum file (export._copy_hf_files)
    return True
