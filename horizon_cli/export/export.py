"""`horizon export`: store (or a run dir's latest checkpoint) -> HF checkpoint directory.

The last stage of the data flow. Writes sharded safetensors with an index, config.json (with the
exported dtype) and the tokenizer files the store carries, into a temp dir renamed when complete.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from ..arch.reward import reward_of
from ..errors import InputError
from ..fsutil import atomic_dir, check_not_inside, io_failures, read_json
from ..lora.merge import Merge, base_store, copy_adapter
from ..progress import byte_progress
from ..store import Store
from ..store.carried import FILE as CARRIED
from ..store.carried import SUM as CARRIED_SUM
from ..store.carried import carried_names, verify_carried
from ..store.ckpt import SUMS, check_given, is_lora
from ..store.ckpt import latest as latest_checkpoint
from ..store.manifest import MANIFEST
from .carried import carried_memory_names, merge_carried
from .safetensors import write_shard

SHARD_BYTES = 5 * 1024**3


def resolve_source(src: Path) -> Path:
    """A store, or a run dir whose latest complete checkpoint is a store."""
    src = Path(src)
    if (src / MANIFEST).is_file() or is_lora(src):  # a store, or a LoRA run's checkpoint
        if (src / SUMS).is_file() or is_lora(src):  # a checkpoint: every listed file as written
            check_given(src)
        return src
    if not src.exists():
        from ..convert.hub import hub_id

        if hub_id(src) is not None:  # as train says it
            raise InputError(
                f"{src}: no local directory, and as a Hugging Face Hub id not a store: convert it first "
                f"(horizon convert {src} STORE)"
            )
        raise InputError(f"{src}: not found")
    if (src / "checkpoints").is_dir():
        found = latest_checkpoint(src)  # store.ckpt: the one definition of an intact checkpoint
        if found is not None:
            return found
        raise InputError(f"{src}: run dir has no complete checkpoint yet")
    raise InputError(f"{src}: neither a store (no {MANIFEST}) nor a run dir with checkpoints")


def export(
    src: str | Path,
    dst: str | Path,
    force: bool = False,
    console=None,
    verify: bool = True,
    adapter: bool = False,
) -> dict:
    """adapter: write a LoRA run's adapter alone (PEFT files); otherwise a LoRA run exports its
    base with the adapters merged (lora/merge.py)."""
    src_dir = resolve_source(Path(src))
    dst = Path(dst)
    check_not_inside(src_dir, dst)
    lora = is_lora(src_dir)
    if adapter and not lora:
        raise InputError(f"--adapter: {src} is not a LoRA run (no adapter in {src_dir})")
    if adapter:
        with io_failures(dst), atomic_dir(dst, force=force) as tmp:
            copy_adapter(src_dir, tmp)
        return {"params": 0, "shards": 1, "dtype": "float32", "source": str(src_dir), "adapter": True}
    store = base_store(src_dir) if lora else Store.open(src_dir)
    merge = Merge(src_dir) if lora else None
    cfg = _hf_config(store)
    entries = [
        (s.hf, s.shape, getattr(torch, s.dtype) if s.dtype else store.dtype, u.name, s.name)
        for u in store.units
        for s in store.layout(u.name).slots
    ]  # an integer buffer in its own dtype (store.layout.Slot.dtype)
    shards = _plan_shards(entries, store.dtype.itemsize)
    total = sum(math.prod(e[1]) * e[2].itemsize for e in entries)
    n = len(shards)
    weight_map = {}
    verified: set[str] = set()

    where = {e[0]: (e[3], e[4]) for e in entries}  # HF name -> (unit, store name)
    inside = _params_inside(store) if merge is not None else {}
    dtypes = {e[0]: e[2] for e in entries}
    carried = carried_memory_names(store) if merge is not None else {}
    if merge is not None:  # adapters on the decoder's tensors, and on carried ones (a projector's)
        merge.check(set(where) | {p[0] for ps in inside.values() for p in ps} | set(carried))

    def fetch(hf: str) -> torch.Tensor:
        unit, name = where[hf]
        if verify and unit not in verified:  # checksums before a unit's first byte is exported
            store.verify_unit(unit)
            verified.add(unit)
        t = store.tensor(unit, name)  # an NF4 tensor comes dequantized
        if dtypes[hf] != t.dtype:
            return t.to(dtypes[hf])  # an integer buffer, exact in the store's floats
        return t if merge is None else merge(hf, t, inside.get(hf, ()))

    with io_failures(dst), atomic_dir(dst, force=force) as tmp:
        with byte_progress(console, f"export {src_dir.name}", total) as advance:
            for k, shard in enumerate(shards):
                fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
                write_shard(tmp / fname, [(e[0], e[1], e[2]) for e in shard], fetch, advance)
                weight_map.update({e[0]: fname for e in shard})
        if verify:
            verify_carried(store.root / "hf")
        weight_map.update(dict.fromkeys(carried_names(store.root / "hf"), CARRIED))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        _copy_hf_files(store, tmp, cfg)
        if merge is not None:
            merge_carried(store, merge, carried, tmp)
    return {
        "params": store.manifest.params,
        "shards": n,
        "dtype": store.manifest.dtype,
        "source": str(src_dir),
    }


def _params_inside(store: Store) -> dict[str, list[tuple[str, int, tuple[int, ...]]]]:
    """Checkpoint name -> the in-memory tensors inside it under another name, (name, element
    offset in it, shape): a renamed one (Sarvam-MoE's `attention.dense` is `self_attn.o_proj`), or
    the several a split makes of one (its `query_key_value` is `q_proj`, `k_proj`, `v_proj`)."""
    out: dict[str, list[tuple[str, int, tuple[int, ...]]]] = {}
    for u in store.units:
        lay = store.layout(u.name)
        for s in lay.slots:
            for p in lay.tensors:
                if p.hf != s.hf and s.offset <= p.offset and p.offset + p.numel <= s.offset + s.numel:
                    out.setdefault(s.hf, []).append((p.hf, p.offset - s.offset, p.shape))
    return out


def _plan_shards(entries: list, itemsize: int) -> list[list]:
    shards: list[list] = []
    cur: list = []
    size = 0
    for e in entries:
        n = math.prod(e[1]) * itemsize
        if cur and size + n > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += n
    if cur:
        shards.append(cur)
    return shards


def _hf_config(store: Store) -> dict:
    """The store's config.json, with the exported dtype and tying."""
    path = store.root / "hf" / "config.json"
    if not path.is_file():
        raise InputError(f"{path}: missing (the store carries no HF config to export with)")
    cfg = read_json(path)
    for k in [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]:
        cfg[k] = store.manifest.dtype
    if reward_of(store.manifest.extra) is None:  # a reward model's decoder is tied as a store only
        cfg["tie_word_embeddings"] = store.arch.tie_embeddings
    return cfg


def _copy_hf_files(store: Store, tmp: Path, cfg: dict) -> None:
    for f in sorted((store.root / "hf").iterdir()):
        if f.name not in ("config.json", CARRIED_SUM) and f.is_file():
            shutil.copyfile(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
