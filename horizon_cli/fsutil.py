"""Atomic file-system writes: nothing half-written is ever left under a final name (and the
reads that name the file at fault)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import owner
from .errors import HorizonError, InputError
from .faults import phase


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


def check_destination(dst: Path, force: bool) -> list[Path]:
    """InputError unless dst may be written; creates missing parents and returns them (outermost
    first) so a failed command can remove them again."""
    if os.path.lexists(dst) and not force:
        raise InputError(f"{dst}: already exists (use --force to replace it)")
    parent = dst.parent if str(dst.parent) else Path(".")
    created = [p for p in (parent, *parent.parents) if not os.path.lexists(p)][::-1]
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{parent}: cannot create the destination's folder ({e.strerror or e})") from None
    if not os.access(parent, os.W_OK):
        raise InputError(f"{parent}: not writable")
    return created


@contextlib.contextmanager
def io_failures(dst: Path) -> Iterator[None]:
    """A failed read or write (disk full, I/O error) while making dst is a run-time failure: one
    line naming the file, exit status 1 (HorizonError), not a traceback."""
    try:
        yield
    except OSError as e:
        raise HorizonError(f"{e.filename or dst}: {e.strerror or e} (nothing was written to {dst})") from None


def check_not_inside(src: Path, dst: Path) -> None:
    """Replacing DST must never delete the source: refuse DST == SRC or a DST that contains it."""
    s, d = Path(src).resolve(), Path(dst).resolve()
    if s == d or d in s.parents:
        raise InputError(f"{dst}: would replace the source {src}; choose another destination")


@contextlib.contextmanager
def atomic_dir(dst: Path, force: bool = False, sync: bool = True) -> Iterator[Path]:
    """Yield a temp dir beside dst; on success fsync it and rename it to dst (replacing dst when
    force). On any exception the temp dir (and any parent folder made for it) is removed and dst
    is untouched. The temp dir's name records its owner, so what a killed process leaves is
    swept by the next command writing into the same folder (this one sweeps first)."""
    dst = Path(dst)
    created = check_destination(dst, force)
    owner.sweep(dst.parent)
    tmp = dst.parent / owner.temp_name(dst.name)  # named before it exists: no window leaves it behind
    try:
        os.mkdir(tmp, 0o777)  # the umask applies: a normal dir's mode
        yield tmp
        phase("atomic-dir-filled")  # a crash-test mark: everything written, nothing renamed yet
        if sync:
            fsync_tree(tmp)
        replace_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in reversed(created):
            with contextlib.suppress(OSError):
                p.rmdir()  # only while still empty
        raise


def replace_dir(src: Path, dst: Path) -> None:
    """Rename src to dst. An existing dst is swapped with src in one atomic step where the file
    system allows it (Linux renameat2 RENAME_EXCHANGE), so dst names either the old or the new
    tree at every instant; elsewhere it is moved aside first. The old tree is removed last.
    src is an owner-named temp (owner.temp_name): after a swap it holds the old tree under that
    name, so a kill during the removal leaves debris the next sweep recognises."""
    src, dst = Path(src), Path(dst)
    if not os.path.lexists(dst):
        os.rename(src, dst)
        fsync_dir(dst.parent)
        return
    if _exchange(src, dst):
        old = src  # src now holds the old tree (under its temp name: a sweep knows its owner)
    else:
        old = dst.parent / owner.temp_name(dst.name, "old")
        os.rename(dst, old)
        os.rename(src, dst)
    fsync_dir(dst.parent)
    owner.remove(old)


RENAME_EXCHANGE = 2
AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths on the same file system; False when unsupported here."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
        return False  # a file system or kernel without RENAME_EXCHANGE
    raise OSError(err, os.strerror(err), str(b))


class _CopyFailed(Exception):
    """Carries a file copy's OSError through shutil.copytree, which would collect it into a list."""

    def __init__(self, err: OSError):
        self.err = err


def copy_tree(src: Path, dst: Path) -> None:
    """shutil.copytree, but the first file that cannot be copied (a full disk) raises its own
    OSError, naming the file and its strerror, at once: copytree would go on with the other files
    and raise shutil.Error holding a list of (src, dst, why) tuples, which reads as a Python list."""

    def copy(a: str, b: str) -> object:
        try:
            return shutil.copy2(a, b)
        except OSError as e:
            raise _CopyFailed(e) from None

    try:
        shutil.copytree(src, dst, copy_function=copy)
    except _CopyFailed as f:
        raise f.err from None
    except shutil.Error as e:  # a folder's copystat: the first failure, as one OSError
        first = e.args[0][0] if e.args and e.args[0] else (src, dst, str(e))
        raise OSError(None, str(first[2]), str(first[1])) from None


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a temp sibling, fsync, rename over `path`. On failure (a full disk...)
    the temp file is removed, `path` is as it was, and the OSError names `path`."""
    path = Path(path)
    tmp = path.with_name(owner.temp_name(path.name))
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and e.filename != str(path):
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def read_exact(path: Path, buf: memoryview, offset: int = 0) -> None:
    """Fill `buf` from byte `offset` of the file with unbuffered reads (no page-cache mapping
    stays in our RSS); InputError naming the file when it is shorter."""
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        n = 0
        while n < len(buf):
            got = f.readinto(buf[n:])
            if not got:
                raise InputError(f"{path}: truncated")
            n += got


def read_json(path: Path) -> Any:
    """The JSON document in `path` (an existing file); InputError naming it when it is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
