"""A checkpoint on disk: what makes one complete and intact. A checkpoint is a store plus state;
`train` writes and resumes them, `export` reads them, both through these definitions.

    <run>/checkpoints/step_N/
      manifest.json, units/, hf/   a store of the trained weights (per-tensor CRC32s in the manifest);
                                   LoRA runs: adapter/ instead (a PEFT adapter, train/checkpoint.py)
      state/<unit>.<buf>.bin       the rest of the training state, raw
      state/trainer.json           step, optimizer step, RNG, model fingerprint
      state/config.yaml            the resolved config the checkpoint was trained with
      checksums.json               size of every file above, CRC32 of every file but the unit
                                   files (covered tensor by tensor by the manifest), and a CRC32
                                   of its own listing

A checkpoint is *complete* when a directory named step_N holds a checksums.json whose own
checksum holds: it is written last into a temp dir that is renamed to step_N only afterwards.
It is *intact* (`check`) when every listed file is there with its size and checksum. A damaged
one is renamed aside (`quarantine`), never deleted. Pruning renames a checkpoint to an
owner-named temp first, so a kill during the deletion leaves debris that `sweep` recognises,
never a half-deleted step_N.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from pathlib import Path

from .. import owner
from ..errors import InputError
from ..faults import phase
from .reader import Store

SUMS = "checksums.json"
TRAINER = "state/trainer.json"
CONFIG = "state/config.yaml"
DAMAGED = ".damaged"
_NAME = re.compile(r"step_(\d+)")


class CheckpointDamaged(InputError):
    """A checkpoint whose files do not match their checksums (or are missing)."""


def step_of(ck: Path) -> int:
    return int(Path(ck).name.split("_")[1])


def listed(run_dir: Path) -> list[Path]:
    """The step_N directories with a checksums file, oldest first (not yet checked)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.fullmatch(p.name) and (p / SUMS).is_file()]
    return sorted(found, key=step_of)


def crc_file(path: Path) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_sums(ck: Path, known: dict[str, int]) -> None:
    """List every file under `ck` with its size and CRC32 (from `known` for the big state files,
    computed here for small ones; none for unit files). Written last, atomically within ck."""
    files = {}
    for p in sorted(ck.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(ck).as_posix()
        crc = known.get(rel, None if rel.startswith("units/") else crc_file(p))
        files[rel] = [p.stat().st_size, crc]
    body = {"files": files, "crc32": _listing_crc(files)}
    (ck / SUMS).write_text(json.dumps(body, indent=0))


def _listing_crc(files: dict) -> int:
    return zlib.crc32(json.dumps(files, sort_keys=True).encode())


def read_sums(ck: Path) -> dict[str, list]:
    """{relative path: [size, crc32 or None]}; CheckpointDamaged when the listing is corrupt."""
    try:
        body = json.loads((Path(ck) / SUMS).read_text())
        files = body["files"]
        ok = _listing_crc(files) == body["crc32"]
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointDamaged(f"{Path(ck) / SUMS}: unreadable or fails its own checksum")
    return files


def check(ck: Path, deep: bool = False) -> str | None:
    """None when intact, else what is wrong (one line). Shallow: the listing, every file's size,
    the checksums of the small files (json, yaml, tokenizer). Deep: every byte."""
    ck = Path(ck)
    try:
        files = read_sums(ck)
    except CheckpointDamaged as e:
        return str(e)
    for rel, (size, crc) in files.items():
        p = ck / rel
        if not p.is_file() or p.stat().st_size != size:
            return f"{p}: missing or not {size} bytes"
        if crc is not None and (deep or size < (1 << 20)) and crc_file(p) != crc:
            return f"{p}: checksum mismatch"
    if deep and (ck / "manifest.json").is_file():  # a LoRA checkpoint holds no store
        try:
            Store.open(ck).verify()
        except InputError as e:
            return str(e)
    return None


def check_given(ck: Path) -> None:
    """A checkpoint named directly (`horizon export RUN/checkpoints/step_N`) is read only when
    intact: CheckpointDamaged naming the file at fault. A LoRA checkpoint is checked byte for byte
    (its adapter files are what is read, and small); a store's unit files are left to the tensor
    checksums its reader checks."""
    why = check(ck, deep=is_lora(ck))
    if why is not None:
        raise CheckpointDamaged(
            f"{why} (a damaged checkpoint: `horizon export` of its run dir takes the newest intact one)"
        )


def intact(run_dir: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """(complete checkpoints that pass the shallow check, newest first; [(damaged one, why)])."""
    good, bad = [], []
    for ck in reversed(listed(run_dir)):
        why = check(ck)
        if why is None:
            good.append(ck)
        else:
            bad.append((ck, why))
    return good, bad


def is_lora(ck: Path) -> bool:
    """A LoRA run's checkpoint: adapters and trainer state, no store (trainer.json names the
    frozen base). A run dir's own adapter/ (the finished run's copy) does not make it one."""
    ck = Path(ck)
    adapter, trainer = (ck / "adapter" / "adapter_config.json").is_file(), (ck / TRAINER).is_file()
    return adapter and trainer and not (ck / "manifest.json").is_file()


def latest(run_dir: Path) -> Path | None:
    """The newest intact checkpoint (what `horizon export RUN_DIR` exports)."""
    good, _ = intact(run_dir)
    return good[0] if good else None


def read_trainer(ck: Path) -> dict:
    return json.loads((Path(ck) / TRAINER).read_text())


def read_config_text(ck: Path) -> str | None:
    p = Path(ck) / CONFIG
    return p.read_text() if p.is_file() else None


def quarantine(ck: Path) -> Path:
    """Rename a damaged checkpoint aside (step_N.damaged, .damaged-2, ...); never deleted."""
    for k in range(1, 1000):
        aside = ck.with_name(ck.name + DAMAGED + ("" if k == 1 else f"-{k}"))
        if not os.path.lexists(aside):
            os.rename(ck, aside)
            return aside
    raise OSError(f"{ck}: too many damaged copies beside it")


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints: each is first renamed to an
    owner-named temp (one atomic step), then removed."""
    gone = []
    for old in listed(run_dir)[:-keep_last]:
        phase("prune", step_of(old))
        doomed = old.with_name(owner.temp_name(old.name, "del"))
        os.rename(old, doomed)
        phase("prune-renamed", step_of(old))
        owner.remove(doomed)
        gone.append(old)
    return gone


def sweep(run_dir: Path) -> list[Path]:
    """Remove debris of dead processes from a run dir: temp checkpoints, half-pruned ones, temp
    files of atomic writes. The caller holds the run-dir lock."""
    root = Path(run_dir)
    return owner.sweep(root / "checkpoints") + owner.sweep(root)


def model_fingerprint(store: Store) -> str:
    """Identity of a starting model: its architecture and every tensor checksum. The architecture
    without the generic section's version (arch.generic_arch): a store converted before it had one
    keeps its fingerprint, and its runs resume."""
    h = hashlib.sha256(json.dumps(store.arch.to_dict(versioned=False), sort_keys=True).encode())
    for u in store.units:
        for t in u.tensors:
            h.update(f"{t.hf}:{t.crc32};".encode())
    return h.hexdigest()[:16]
