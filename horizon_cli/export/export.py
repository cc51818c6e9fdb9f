"""`horizon export`: store (or a run dir's latest checkpoint) -> HF checkpoint directory.

The last stage of the data flow. Writes sharded safetensors with an index, config.json (with the
exported dtype) and the tokenizer files the store carries, into a temp dir renamed when complete.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from ..errors import InputError
from ..fsutil import atomic_dir
from ..progress import byte_progress
from ..store import Store
from .safetensors import write_shard

SHARD_BYTES = 5 * 1024**3


def resolve_source(src: Path) -> Path:
    """A store, or a run dir whose latest complete checkpoint is a store."""
    if (src / "manifest.json").is_file():
        return src
    ck = src / "checkpoints"
    if ck.is_dir():
        steps = sorted(
            (p for p in ck.iterdir() if p.name.startswith("step_") and (p / "manifest.json").is_file()),
            key=lambda p: int(p.name.split("_")[1]),
        )
        if steps:
            return steps[-1]
        raise InputError(f"{src}: run dir has no complete checkpoint yet")
    if not src.exists():
        raise InputError(f"{src}: not found")
    raise InputError(f"{src}: neither a store nor a run dir with checkpoints")


def export(src: str | Path, dst: str | Path, force: bool = False, console=None, verify: bool = True) -> dict:
    src_dir = resolve_source(Path(src))
    store = Store.open(src_dir)
    dst = Path(dst)
    entries = [(s.hf, s.shape, store.dtype, u.name, s.name) for u in store.units for s in store.layout(u.name).slots]
    shards = _plan_shards(entries, store.dtype.itemsize)
    total = sum(math.prod(e[1]) for e in entries) * store.dtype.itemsize
    n = len(shards)
    weight_map = {}
    with atomic_dir(dst, force=force) as tmp:
        with byte_progress(console, f"export {src_dir.name}", total) as advance:
            for k, shard in enumerate(shards):
                fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
                lookup = {e[0]: e for e in shard}
                done: set[str] = set()

                def fetch(hf: str, lookup=lookup, done=done):
                    unit, name = lookup[hf][3], lookup[hf][4]
                    if verify and unit not in done:
                        store.verify_unit(unit)
                        done.add(unit)
                    return store.tensor(unit, name)

                write_shard(tmp / fname, [(e[0], e[1], e[2]) for e in shard], fetch, advance)
                weight_map.update({e[0]: fname for e in shard})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        _copy_hf_files(store, tmp)
    return {"params": store.manifest.params, "shards": n, "dtype": store.manifest.dtype, "source": str(src_dir)}


def _plan_shards(entries: list, itemsize: int) -> list[list]:
    shards, cur, size = [], [], 0
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


def _copy_hf_files(store: Store, tmp: Path) -> None:
    hf = store.root / "hf"
    for f in sorted(hf.iterdir()) if hf.is_dir() else []:
        if f.name != "config.json":
            shutil.copyfile(f, tmp / f.name)
    cfg = json.loads((hf / "config.json").read_text()) if (hf / "config.json").is_file() else {}
    if not cfg:
        raise InputError(f"{store.root}: store has no hf/config.json to export with")
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["torch_dtype"]
    for k in keys:
        cfg[k] = store.manifest.dtype
    cfg["tie_word_embeddings"] = store.arch.tie_embeddings
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
