"""Saving and restoring the engine's training state as a checkpoint (the on-disk definition,
checks, pruning and sweeping live beside the store, in store/ckpt.py).

    state/<unit>.<buf>.bin   raw optimizer state (state/host.py): exact `lo` (bf16 runs: the fp32
                             master's low half), `m`, `v`; lean `lo8`, `qm`, `qw`, `sm`, `sw` (and
                             the exact kind's, packed, for its 1-D tensors)
    state/trainer.json       step, optimizer step count, RNG, model fingerprint, ...
    state/config.yaml        the resolved config of the run that wrote it

A LoRA run's checkpoint holds no store (the base never changes; trainer.json names it and its
fingerprint) but its adapters as a PEFT adapter, with their exact fp32 masters:

    adapter/adapter_config.json, adapter/adapter_model.safetensors   (lora/peft.py)
    state/lora.<i>.m.bin, .v.bin                                      AdamW moments

Written into an owner-named temp dir beside the others, with the checksums file last, fsynced,
then renamed to step_N: a crash or a full disk leaves the previous checkpoints as they were.

Sharded runs write and read the same files, each rank its slices (train/sharded_checkpoint.py),
or rank 0 all of them where every rank holds the same (LoRA's adapters): the engine's placement
(engine.ranks.Placement) picks the writer and the reader; what the weights are is the engine's
tuning's (engine.tuning).
"""

from __future__ import annotations

import ast
import json
import os
import random
import shutil
import zlib
from pathlib import Path

import numpy as np
import torch

from .. import owner
from ..engine.ranks import Placement
from ..errors import HorizonError, InputError
from ..faults import phase
from ..fsutil import fsync_tree, read_exact, replace_dir
from ..optim.modes import OLDEST_FORM
from ..store import Store, ckpt
from ..store.writer import tensor_bytes
from . import sharded_checkpoint


def save(
    engine, run_dir: Path, step: int, trainer: dict, config_yaml: str, model_store: Store, keep_last: int
) -> Path:
    """Write checkpoint step_N for the engine's current (fully updated) state, then prune: as its
    trained state lies over the ranks (engine.placement)."""
    return SAVE[engine.placement](engine, run_dir, step, trainer, config_yaml, model_store, keep_last)


def _save_slices(
    engine, run_dir: Path, step: int, trainer: dict, config_yaml: str, model_store: Store, keep_last: int
) -> Path:
    """Every rank its slices (train/sharded_checkpoint.py); what the embedding stage trains (a
    vision tower, whole and the same on every rank) rank 0 writes once, beside the store's hf/."""

    def meta(tmp: Path, known: dict[str, int]) -> None:
        _write_meta(tmp, trainer, config_yaml, {**known, **_stage_state(engine, tmp)})

    comm, buffers = engine.ranks.comm, engine.tuning.state_buffers
    return sharded_checkpoint.save(
        engine, comm, run_dir, step, trainer, model_store, keep_last, buffers, meta
    )


def _save_on_rank0(
    engine, run_dir: Path, step: int, trainer: dict, config_yaml: str, model_store: Store, keep_last: int
) -> Path:
    """The state is whole (and the same) on every rank: rank 0 writes it."""
    return sharded_checkpoint.on_rank0(
        engine,
        engine.ranks.comm,
        lambda: _save(engine, run_dir, step, trainer, config_yaml, model_store, keep_last),
    )


def _save(
    engine, run_dir: Path, step: int, trainer: dict, config_yaml: str, model_store: Store, keep_last: int
) -> Path:
    engine.wait()
    phase("checkpoint", step)
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / owner.temp_name(final.name)  # named before it exists: no window leaves it behind
    try:
        os.mkdir(tmp, 0o777)  # the umask applies, as to any directory the user makes
        _write(engine, tmp, trainer, config_yaml, model_store)
        phase("checkpoint-written", step)
        fsync_tree(tmp)
        phase("checkpoint-synced", step)
        replace_dir(tmp, final)
        phase("checkpoint-renamed", step)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise HorizonError(
            f"{final}: could not write the checkpoint ({e.strerror or e}); earlier ones are intact"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ckpt.prune(run_dir, keep_last)
    return final


def _write(engine, tmp: Path, trainer: dict, config_yaml: str, model_store: Store) -> None:
    tuning = engine.tuning  # the weights (a store, or a LoRA run's adapter), then the optimizer state
    tuning.write(
        engine.host, engine.spec, engine.host.dtype, tmp, model_store, trainer["step"]
    )  # the streams
    _write_state(engine, tmp, trainer, config_yaml, tuning.state_buffers)


def _stage_state(engine, tmp: Path) -> dict[str, int]:
    """What the embedding stage trains besides the units (a vision tower: vision.trained)."""
    return engine.p.embedding.save_state(tmp)


def _write_state(engine, tmp: Path, trainer: dict, config_yaml: str, keys: tuple[str, ...]) -> None:
    state = tmp / "state"
    state.mkdir()
    sums = {}
    for name, st in engine.host.units.items():
        bufs = st.buffers()
        for key in keys:
            if key in bufs:
                fname = f"{name}.{key}.bin"
                sums[f"state/{fname}"] = _write_raw(state / fname, bufs[key])
    sums.update(_stage_state(engine, tmp))
    _write_meta(tmp, trainer, config_yaml, sums)


def _write_meta(tmp: Path, trainer: dict, config_yaml: str, sums: dict[str, int]) -> None:
    """config.yaml, trainer.json, then the checksums of everything (those in `sums` known)."""
    (tmp / ckpt.CONFIG).write_text(config_yaml)
    (tmp / ckpt.TRAINER).write_text(json.dumps({**trainer, "rng": _rng_state()}, indent=1))
    ckpt.write_sums(tmp, sums)


def _write_raw(path: Path, t: torch.Tensor) -> int:
    data = tensor_bytes(t)
    with open(path, "wb") as f:
        f.write(data)
    return zlib.crc32(data)


def load(engine, ck: Path) -> dict:
    """Restore the engine's master, moments and step count from `ck`; returns trainer.json.
    CheckpointDamaged when a file is missing or fails its checksum.

    The streaming weights come from the checkpoint's store (the engine is built on it)."""
    sums = ckpt.read_sums(ck)
    trainer = ckpt.read_trainer(ck)
    memory = trainer.get("memory", OLDEST_FORM)  # checkpoints from before optim.memory were exact
    if not engine.host.mode.reads(memory):
        raise InputError(
            f"{ck}: trained with optim.memory {memory}, this run has {engine.host.mode.form}; "
            "its optimizer state cannot be read in another mode"
        )
    engine.tuning.read(engine.host, ck, sums)
    keys = LOAD[engine.placement](engine, ck, sums)
    for name, st in engine.host.units.items():
        bufs = st.buffers()
        for key in keys:
            if key not in bufs:
                continue
            rel = f"state/{name}.{key}.bin"
            if rel not in sums or not (ck / rel).is_file():
                raise ckpt.CheckpointDamaged(f"{ck}: checkpoint lacks {rel}")
            _read_raw(ck / rel, bufs[key], sums[rel][1])
    engine.p.embedding.load_state(ck, sums)
    engine.adam_step = trainer["adam_step"]
    _set_rng_state(trainer["rng"])
    return trainer


def _whole(engine, ck: Path, sums: dict) -> tuple[str, ...]:
    """This process reads every unit's state (below)."""
    return engine.tuning.state_buffers


def _slices(engine, ck: Path, sums: dict) -> tuple[str, ...]:
    """This rank's ranges; the checksums split over the ranks. Nothing is left to read."""
    sharded_checkpoint.verify_split(engine.ranks.comm, ck, Store.open(ck))
    sharded_checkpoint.read_slices(engine, ck, sums, engine.tuning.state_buffers)
    return ()


def verify_base(engine, ck: Path | None, src: Store) -> None:
    """A freshly built engine's weights checked against the store they came from: sharded, each
    rank its share of the checksums (a sliced checkpoint's are checked as it loads)."""
    VERIFY[engine.placement](engine.ranks.comm, ck, src)


def _verify_none(comm, ck: Path | None, src: Store) -> None:
    pass  # one process: the store's reader checks what it reads


def _verify_base(comm, ck: Path | None, src: Store) -> None:
    sharded_checkpoint.verify_split(comm, None, src)  # the base is what every rank streams


def _verify_fresh(comm, ck: Path | None, src: Store) -> None:
    if ck is None:  # a resume's checkpoint is checked as it loads (`_slices`)
        sharded_checkpoint.verify_split(comm, None, src)


VERIFY = {Placement.WHOLE: _verify_none, Placement.REPLICATED: _verify_base, Placement.SLICED: _verify_fresh}
SAVE = {Placement.WHOLE: _save, Placement.REPLICATED: _save_on_rank0, Placement.SLICED: _save_slices}
LOAD = {Placement.WHOLE: _whole, Placement.REPLICATED: _whole, Placement.SLICED: _slices}


def _read_raw(path: Path, out: torch.Tensor, crc: int) -> None:
    buf = tensor_bytes(out)
    if os.path.getsize(path) != len(buf):
        raise ckpt.CheckpointDamaged(
            f"{path}: size {os.path.getsize(path)} does not match the model ({len(buf)} bytes)"
        )
    read_exact(path, buf)
    if zlib.crc32(buf) != crc:
        raise ckpt.CheckpointDamaged(f"{path}: checksum mismatch (checkpoint is corrupt)")


def _rng_state() -> dict:
    """The global generators (train.seed seeds them: what reward functions, tools and environments
    draw from, as under TRL's Trainer), so a resumed run draws on as the uninterrupted one."""
    got = np.random.get_state()
    assert isinstance(got, tuple)  # the legacy form: (name, keys, pos, has_gauss, cached)
    name, keys, pos, gauss, cached = got
    return {
        "torch": torch.get_rng_state().tolist(),
        "python": repr(random.getstate()),
        "numpy": [name, keys.tolist(), pos, gauss, cached],
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    random.setstate(ast.literal_eval(state["python"]))
    if "numpy" in state:  # a checkpoint written before it was kept: numpy as seeded
        name, keys, pos, gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, gauss, cached))


def seed_globals(seed: int) -> None:
    """Python's, numpy's and torch's global generators from train.seed at a fresh start, as TRL's
    Trainer seeds them (transformers.set_seed); horizon's own draws use generators of their own."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
