"""Who owns a temp path or a lock: process identities that survive PID reuse, the run-dir lock,
and sweeping what dead processes left behind. Below every stage (fsutil, store, train, optim).

Every temp file or dir horizon makes is named `.<name>.<kind>-<owner>-<random>`, where <owner> is
`<host>-<boot>-<pid>-<start>`: a hash of the host name, a hash of the kernel's boot id, the PID
and the process's start time in clock ticks since boot (/proc/<pid>/stat). A PID alone is not
enough: PIDs are reused, so an owner is alive only while a process with that PID exists *and*
started at that tick; after a reboot every owner of the previous boot is dead. An owner on
another host (a run dir on NFS) is never judged: its debris is left alone.

The run-dir lock is `flock` on `<dir>/.lock`: the kernel drops it when its holder dies however
it dies, so a stale lock is simply taken over; the file holds the holder's PID and host for the
message a second process prints. On Linux NFS clients `flock` is carried out as a POSIX lock on
the server, so it excludes processes on other hosts too (a crashed client's lock lasts until its
lease expires, about 90 s on NFSv4).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

TEMP_RE = re.compile(
    r"\.(?P<name>.+)\.(?P<kind>[a-z]+)-(?P<host>[0-9a-f]{6})-(?P<boot>[0-9a-f]{6})-(?P<pid>\d+)-(?P<start>\d+)-\w+"
)


@dataclass(frozen=True)
class Owner:
    host: str  # 6 hex digits of sha256(hostname)
    boot: str  # 6 hex digits of sha256(boot id), "000000" where the kernel has none
    pid: int
    start: int  # clock ticks after boot, 0 where unknown

    @property
    def tag(self) -> str:
        return f"{self.host}-{self.boot}-{self.pid}-{self.start}"


def _hex6(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:6]


def _boot_id() -> str:
    try:
        return _hex6(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        return "000000"


def start_ticks(pid: int) -> int | None:
    """The process's start time (ticks after boot), 0 where /proc is absent, None if no such PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None if Path("/proc/self/stat").exists() else _start_without_proc(pid)
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22; the name may hold spaces


def _start_without_proc(pid: int) -> int | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0


def me() -> Owner:
    pid = os.getpid()
    return Owner(_hex6(socket.gethostname()), _boot_id(), pid, start_ticks(pid) or 0)


def alive(o: Owner) -> bool:
    """False only when the owner is certainly gone; an owner on another host counts as alive."""
    here = me()
    if o.host != here.host:
        return True
    if o.boot != here.boot:
        return False  # started before the last reboot
    start = start_ticks(o.pid)
    return start is not None and (start == o.start or 0 in (start, o.start))


def temp_name(name: str, kind: str = "tmp") -> str:
    """A hidden sibling name for `name` that records this process as its owner."""
    return f".{name}.{kind}-{me().tag}-{secrets.token_hex(3)}"


def owner_of(path: Path) -> Owner | None:
    m = TEMP_RE.fullmatch(Path(path).name)
    if m is None:
        return None
    return Owner(m["host"], m["boot"], int(m["pid"]), int(m["start"]))


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def sweep(folder: Path) -> list[Path]:
    """Remove the temp files and dirs in `folder` whose owner is dead; returns what went."""
    gone: list[Path] = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return gone
    for p in entries:
        o = owner_of(p)
        if o is not None and not alive(o):
            remove(p)
            gone.append(p)
    return gone


class Locked(Exception):
    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


class DirLock:
    """An exclusive flock on `<dir>/.lock`, held until release() or the holder's death."""

    NAME = ".lock"

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, folder: Path) -> DirLock:
        """Raises Locked(holder description) when a live process holds it; OSError when the
        folder cannot hold a lock file."""
        path = Path(folder) / cls.NAME
        for _ in range(20):  # lost a race with a holder that was removing its file: try again
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise Locked(holder(path)) from None
            if _same_file(fd, path):
                o = me()
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{o.pid} {socket.gethostname()} {o.tag}\n".encode(), 0)
                return cls(path, fd)
            os.close(fd)
        raise Locked(holder(path))

    def release(self) -> None:
        """Unlink while still holding it (a waiter that opened the old file sees it is stale)."""
        if self.fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self.fd)
        self.fd = -1


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def holder(lock_file: Path) -> str:
    """'PID 123 on host' from a lock file (what its holder wrote), or 'another process'."""
    try:
        pid, host, *_ = Path(lock_file).read_text().split()
        return f"PID {int(pid)} on {host}"
    except (OSError, ValueError):
        return "another process (it has not written its PID yet)"


def probe(folder: Path) -> str | None:
    """Who holds `<folder>/.lock` right now (None: nobody), without creating or changing it."""
    path = Path(folder) / DirLock.NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return holder(path)
    finally:
        os.close(fd)  # closing drops the shared lock taken by the probe
    return None
