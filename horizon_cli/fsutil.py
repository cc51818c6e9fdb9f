"""Atomic file-system writes: nothing half-written is ever left under a final name."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import InputError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under root, then every directory (bottom-up)."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def check_destination(dst: Path, force: bool) -> None:
    if dst.exists() and not force:
        raise InputError(f"{dst}: already exists (use --force to replace it)")
    parent = dst.parent if str(dst.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    if not os.access(parent, os.W_OK):
        raise InputError(f"{parent}: not writable")


@contextlib.contextmanager
def atomic_dir(dst: Path, force: bool = False, sync: bool = True) -> Iterator[Path]:
    """Yield a temp dir beside dst; on success fsync it and rename it to dst (replacing dst when
    force). On any exception the temp dir is removed and dst is untouched."""
    dst = Path(dst)
    check_destination(dst, force)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
        if sync:
            fsync_tree(tmp)
        replace_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(src: Path, dst: Path) -> None:
    """Rename src to dst; an existing dst is moved aside first and removed only afterwards."""
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.rename(dst, old)
    os.rename(src, dst)
    fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
