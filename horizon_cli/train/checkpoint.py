"""Checkpoints: complete, self-describing, written atomically, pruned to `keep_last`.

    checkpoints/step_N/
      manifest.json, units/, hf/   a store of the trained weights (the streaming copy, engine dtype):
                                   `horizon export` and `model.path` both accept it
      state/<unit>.<buf>.bin       the rest of the training state, raw: `lo` (bf16 runs: the fp32
                                   master's low half), `m` and `v` (AdamW moments)
      state/trainer.json           step, optimizer step count, RNG, data position, model
                                   fingerprint, and a checksum of every state file

Written into a temp dir beside the others, fsynced, then renamed: a crash or a full disk leaves
the previous checkpoints as they were. Only directories named step_N with a trainer.json count.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import shutil
import tempfile
import zlib
from pathlib import Path

import torch

from ..errors import HorizonError, InputError
from ..faults import maybe_die
from ..fsutil import fsync_tree, read_exact, replace_dir
from ..store import Store, StoreWriter
from ..store.manifest import MANIFEST
from ..store.writer import tensor_bytes

STATE_BUFFERS = ("lo", "m", "v")


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if re.fullmatch(r"step_\d+", p.name)
        and (p / "state" / "trainer.json").is_file()
        and (p / MANIFEST).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def latest(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def save(engine, run_dir: Path, step: int, trainer: dict, model_store: Store, keep_last: int) -> Path:
    """Write checkpoint step_N for the engine's current (fully updated) state."""
    engine.wait()
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step}.tmp-", dir=root))
    try:
        _write(engine, tmp, trainer, model_store)
        maybe_die("checkpoint-written", step)
        fsync_tree(tmp)
        maybe_die("checkpoint-synced", step)
        replace_dir(tmp, final)
        maybe_die("checkpoint-renamed", step)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise HorizonError(
            f"{final}: could not write the checkpoint ({e.strerror or e}); earlier ones are intact"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(run_dir, keep_last)
    return final


def _write(engine, tmp: Path, trainer: dict, model_store: Store) -> None:
    dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[engine.dtype]
    w = StoreWriter(tmp, engine.spec, dtype, source=model_store.manifest.source or str(model_store.root))
    try:
        for name, st in engine.host.units.items():
            w.write_unit(name, st.stream)
        w.finish(extra={"step": trainer["step"]})
    finally:
        w.close()
    if (model_store.root / "hf").is_dir():
        shutil.copytree(model_store.root / "hf", tmp / "hf")
    state = tmp / "state"
    state.mkdir()
    sums = {}
    for name, st in engine.host.units.items():
        bufs = st.buffers()
        for key in STATE_BUFFERS:
            if key in bufs:
                fname = f"{name}.{key}.bin"
                sums[fname] = _write_raw(state / fname, bufs[key])
    trainer = {**trainer, "files": sums, "rng": _rng_state()}
    (state / "trainer.json").write_text(json.dumps(trainer, indent=1))


def _write_raw(path: Path, t: torch.Tensor) -> int:
    data = tensor_bytes(t)
    with open(path, "wb") as f:
        f.write(data)
    return zlib.crc32(data)


def load(engine, ckpt: Path) -> dict:
    """Restore the engine's master, moments and step count from `ckpt`; returns trainer.json.

    The streaming weights come from the checkpoint's store (the engine is built on it)."""
    trainer = json.loads((ckpt / "state" / "trainer.json").read_text())
    for name, st in engine.host.units.items():
        bufs = st.buffers()
        for key in STATE_BUFFERS:
            if key not in bufs:
                continue
            fname = f"{name}.{key}.bin"
            path = ckpt / "state" / fname
            if fname not in trainer["files"] or not path.is_file():
                raise InputError(
                    f"{ckpt}: checkpoint lacks {fname} (was it written by another engine.dtype?)"
                )
            _read_raw(path, bufs[key], trainer["files"][fname])
    engine.adam_step = trainer["adam_step"]
    _set_rng_state(trainer["rng"])
    return trainer


def _read_raw(path: Path, out: torch.Tensor, crc: int) -> None:
    buf = tensor_bytes(out)
    if os.path.getsize(path) != len(buf):
        raise InputError(f"{path}: size {os.path.getsize(path)} does not match the model ({len(buf)} bytes)")
    read_exact(path, buf)
    if zlib.crc32(buf) != crc:
        raise InputError(f"{path}: checksum mismatch (checkpoint is corrupt)")


def prune(run_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints; also sweep temp dirs left by a killed run."""
    for old in checkpoint_dirs(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    root = Path(run_dir) / "checkpoints"
    for p in root.iterdir() if root.is_dir() else []:
        if p.name.startswith(".step_"):
            shutil.rmtree(p, ignore_errors=True)


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state().tolist(), "python": repr(random.getstate())}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    random.setstate(ast.literal_eval(state["python"]))
