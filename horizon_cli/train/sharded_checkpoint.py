"""Checkpoints of a sharded run: every rank writes its slices, any world size reads them.

A sharded checkpoint is the same directory as a single-process one (store/ckpt.py): whole
unit files and whole state files, each a flat buffer of the unit in global element order. Every
rank writes its slice of each buffer at its global offset (UnitState.ranges) into files rank 0
created at full size, so the files are world-size independent and resharding on load is reading
another range: a checkpoint written by N ranks resumes on M ranks, or on one process, and
`horizon export` reads it as it is. This is DCP's rule (every region carries its global offset)
with the offsets implied by the flat layout.

    rank 0    makes the temp dir and the full-size (sparse) files      -> broadcast its name
    all       pwrite + fsync their slices, CRC32 each slice (and each
              tensor's part of it)                                     -> gather errors, CRCs
    rank 0    manifest (per-tensor CRC32s combined from the parts: parallel/crc.py), hf/
              (a trained vision tower, whole on every rank: its tensors and state, once),
              trainer.json, config.yaml, checksums.json last; fsync, rename, prune -> broadcast

No rank reads the checkpoint back; verifying it on load is split over the ranks.
A shared file system is assumed for the run dir when the ranks span several nodes.
"""

from __future__ import annotations

import os
import shutil
import zlib
from pathlib import Path

from .. import __version__, owner
from ..errors import HorizonError, InputError
from ..faults import phase
from ..fsutil import copy_tree, fsync_tree, read_exact, replace_dir
from ..parallel.comm import Dist
from ..parallel.crc import crc32_of_pieces
from ..store import Store, ckpt
from ..store.layout import file_bytes, layouts
from ..store.manifest import DTYPE_NAMES, MANIFEST, Manifest, TensorEntry, UnitEntry, unit_file
from ..store.writer import tensor_bytes


def _files(engine, state_keys: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(relative path, unit, buffer key) of every file the checkpoint's buffers go to."""
    out = []
    for name, st in engine.host.units.items():
        out.append((unit_file(name), name, "stream"))
        out += [(f"state/{name}.{k}.bin", name, k) for k in state_keys if k in st.ranges]
    return out


def save(
    engine,
    d: Dist,
    run_dir: Path,
    step: int,
    trainer: dict,
    model_store: Store,
    keep_last: int,
    state_keys: tuple[str, ...],
    write_meta,
) -> Path:
    """Write checkpoint step_N from every rank's slices (a collective: every rank calls it)."""
    engine.wait()
    phase("checkpoint", step)
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step}"
    files = _files(engine, state_keys)
    tmp, err = None, None
    if d.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / owner.temp_name(final.name)
            _create(engine, tmp, files)
        except OSError as e:
            err = f"{tmp or root}: could not create the checkpoint ({e.strerror or e})"
    tmp_s, err = d.broadcast_object((str(tmp), err))
    tmp = Path(tmp_s)
    pieces: list = []
    if err is None:
        try:
            pieces = _write_slices(engine, tmp, files)
        except OSError as e:
            err = f"{tmp}: rank {d.rank} could not write its slices ({e.strerror or e})"
    got = d.gather_objects((err, pieces))
    errs = [e for e, _ in got if e]
    err = errs[0] if errs else None
    if d.is_main:
        crcs = _combine([p for _, ps in got for p in ps])
        err = err or _finish(engine, tmp, final, trainer, crcs, model_store, write_meta)
        if err is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            ckpt.prune(run_dir, keep_last)
    err = d.broadcast_object(err)
    if err:
        raise HorizonError(f"{final}: {err}; earlier checkpoints are intact")
    return final


def _create(engine, tmp: Path, files: list[tuple[str, str, str]]) -> None:
    os.mkdir(tmp, 0o777)
    (tmp / "units").mkdir()
    (tmp / "state").mkdir()
    for rel, unit, key in files:
        st = engine.host[unit]
        item = st.buffers()[key].element_size()
        n = st.ranges[key][2] * item
        with open(tmp / rel, "wb") as f:
            f.truncate(file_bytes(st.layout.numel, item) if key == "stream" else n)  # sparse zeros


def _write_slices(engine, tmp: Path, files: list[tuple[str, str, str]]) -> list[tuple]:
    """Write this rank's slices; returns their CRC32s as (what, byte offset, crc, length): a state
    file's slice under its path, a stream slice per tensor it overlaps, as (unit, tensor)."""
    pieces: list[tuple] = []
    for rel, unit, key in files:
        st = engine.host[unit]
        buf = st.buffers()[key]
        lo = st.ranges[key][0]
        data = tensor_bytes(buf)
        base = lo * buf.element_size()
        if key == "stream":
            pieces += _tensor_pieces(st.layout, data, base, buf.element_size())
        elif len(data):
            pieces.append((rel, base, zlib.crc32(data), len(data)))
        fd = os.open(tmp / rel, os.O_WRONLY)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], lo * buf.element_size() + done)
            os.fsync(fd)  # this rank's pages, whichever node it runs on
        finally:
            os.close(fd)
    return pieces


def _tensor_pieces(layout, data: memoryview, base: int, item: int) -> list[tuple]:
    """CRC32s of the parts of each checkpoint tensor inside a stream slice at byte `base`."""
    out = []
    for s in layout.slots:
        a, b = max(s.offset * item, base), min((s.offset + s.numel) * item, base + len(data))
        if a < b:
            out.append(((layout.name, s.name), a, zlib.crc32(data[a - base : b - base]), b - a))
    return out


def _combine(pieces: list[tuple]) -> dict:
    """Every rank's slice CRCs -> one CRC32 per state file and per tensor."""
    by: dict = {}
    for what, off, crc, n in pieces:
        by.setdefault(what, []).append((off, crc, n))
    return {what: crc32_of_pieces(ps) for what, ps in by.items()}


def _finish(engine, tmp, final, trainer, crcs: dict, model_store, write_meta) -> str | None:
    try:
        _manifest(engine, tmp, trainer["step"], model_store, crcs)
        phase("checkpoint-store", trainer["step"])
        if (model_store.root / "hf").is_dir():
            copy_tree(model_store.root / "hf", tmp / "hf")
        known = {k: v for k, v in crcs.items() if isinstance(k, str)}  # the state files'
        write_meta(tmp, known)  # trainer.json, config.yaml, then checksums.json
        phase("checkpoint-written", trainer["step"])
        fsync_tree(tmp)
        phase("checkpoint-synced", trainer["step"])
        replace_dir(tmp, final)
        phase("checkpoint-renamed", trainer["step"])
    except OSError as e:
        return f"could not write the checkpoint ({e.strerror or e})"
    return None


def _manifest(engine, tmp: Path, step: int, model_store: Store, crcs: dict) -> None:
    """The store's manifest, its per-tensor checksums combined from the ranks' parts."""
    dtype = DTYPE_NAMES[engine.host.dtype]  # the streaming copies' (lean: bf16 whatever it computes in)
    item = engine.host.dtype.itemsize
    units = []
    for lay in layouts(engine.spec):
        tensors = []
        for s in lay.slots:
            off, n = s.offset * item, s.numel * item
            crc = crcs[(lay.name, s.name)]
            tensors.append(TensorEntry(s.name, s.hf, dtype, list(s.shape), off, n, crc))
        units.append(
            UnitEntry(lay.name, unit_file(lay.name), lay.numel, file_bytes(lay.numel, item), tensors)
        )
    m = Manifest(
        dtype=dtype,
        arch=engine.spec,
        units=units,
        params=sum(lay.params for lay in layouts(engine.spec)),
        source=model_store.manifest.source or str(model_store.root),
        created_by=f"horizon {__version__}",
        extra={"step": step},
    )
    (tmp / MANIFEST).write_text(m.to_json())


def on_rank0(engine, d: Dist, save_fn) -> Path:
    """A checkpoint that rank 0 alone writes (a LoRA run's: its adapters are whole on every
    rank); the others wait for it and raise the same error if it failed."""
    engine.wait()
    path, err = None, None
    if d.is_main:
        try:
            path = save_fn()
        except HorizonError as e:
            d.broadcast_object((None, str(e)))
            raise
    path, err = d.broadcast_object((str(path) if path else None, err))
    if err:
        raise HorizonError(err)
    return Path(path)


# -- load ----------------------------------------------------------------------------------------
def verify_split(d: Dist, ck: Path | None, store: Store) -> None:
    """Check every checksum once, the files split over the ranks: the store's unit files (and a
    checkpoint's state files). Every rank raises the same CheckpointDamaged (or InputError for
    a damaged model store, exit 2 as on one process) when any rank found one."""
    jobs: list[tuple[str, str]] = [("unit", u.name) for u in store.units]
    sums = ckpt.read_sums(ck) if ck is not None else {}
    jobs += [("file", rel) for rel in sorted(sums) if rel.startswith("state/") and rel.endswith(".bin")]
    err = None
    for kind, what in jobs[d.rank :: d.world]:
        try:
            if kind == "unit":
                store.verify_unit(what)
            elif ck is not None and ckpt.crc_file(ck / what) != sums[what][1]:
                err = f"{ck / what}: checksum mismatch (checkpoint is corrupt)"
        except (OSError, HorizonError) as e:
            err = str(e)
        if err:
            break
    errs = [e for e in d.gather_objects(err) if e]
    if errs:
        raise (ckpt.CheckpointDamaged if ck is not None else InputError)(errs[0])


def read_slices(engine, ck: Path, sums: dict, state_keys: tuple[str, ...]) -> None:
    """Read this rank's range of every state buffer (the streams came with the store)."""
    for rel, unit, key in _files(engine, state_keys):
        if key == "stream":
            continue
        st = engine.host[unit]
        buf = st.buffers()[key]
        lo, _, total = st.ranges[key]
        path = ck / rel
        if rel not in sums or not path.is_file():
            raise ckpt.CheckpointDamaged(f"{ck}: checkpoint lacks {rel}")
        item = buf.element_size()
        if os.path.getsize(path) != total * item:
            raise ckpt.CheckpointDamaged(
                f"{path}: size {os.path.getsize(path)} does not match the model ({total * item} bytes)"
            )
        read_exact(path, tensor_bytes(buf), lo * item)
