"""Checks commands run before they start work: the device exists, how much host memory this
process may really use (the machine a plan is judged against), and that output files can be
written. Each failure is bad input (exit 2).
"""

from __future__ import annotations

import math
import os
import resource
from pathlib import Path

import psutil

from .errors import InputError
from .fmt import fmt_bytes
from .planning.fit import Machine
from .runtime.device import check_device, cuda_index

CGROUP = Path("/sys/fs/cgroup")
_UNLIMITED_V1 = 1 << 60  # cgroup v1 writes 9223372036854771712 for "no limit"


def host_available() -> tuple[int, str]:
    """(bytes this process can still allocate, what limits it): the least of free RAM, the
    address-space rlimit (RLIMIT_AS) and the cgroup's memory limit (v2 memory.max, v1
    memory.limit_in_bytes, this cgroup and its ancestors), each less what is already used."""
    found = [(psutil.virtual_memory().available, "available RAM")]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        used = psutil.Process().memory_info().vms
        found.append((max(0, soft - used), f"RLIMIT_AS {fmt_bytes(soft)} (ulimit -v)"))
    found += cgroup_headroom()
    return min(found, key=lambda x: x[0])


def cgroup_headroom(
    root: Path = CGROUP, self_cgroup: Path = Path("/proc/self/cgroup")
) -> list[tuple[int, str]]:
    """[(limit - usage, description)] for every memory limit on this process's cgroup path."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            out += _limits(root, path, "memory.max", "memory.current", "cgroup memory.max")
        elif "memory" in controllers.split(","):
            out += _limits(
                root / "memory",
                path,
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "cgroup memory.limit_in_bytes",
            )
    return out


def _limits(base: Path, path: str, limit_file: str, usage_file: str, what: str) -> list[tuple[int, str]]:
    """Walk from the process's cgroup up to the root of the mounted hierarchy (inside a cgroup
    namespace the mount root is the process's own cgroup, so missing levels are skipped)."""
    out = []
    rel = Path(path.lstrip("/"))
    for d in [base / rel, *[base / p for p in rel.parents]]:
        try:
            limit_text = (d / limit_file).read_text().strip()
            usage = int((d / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= _UNLIMITED_V1:
            continue
        limit = int(limit_text)
        out.append((max(0, limit - usage), f"{what} {fmt_bytes(limit)} ({d})"))
    return out


def check_output_file(path: Path | None, what: str) -> None:
    """An output file named on the command line can be written: its folder exists and is
    writable, and it is not a directory. Checked before any work is done."""
    if path is None:
        return
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(f"{what}: {path} is a directory")
    if not parent.is_dir():
        raise InputError(f"{what}: {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"{what}: {path} is not writable")


def local_machine(cfg) -> Machine:
    """What this process may allocate, and the configured device (checked to exist)."""
    device = check_device(cfg.engine)
    avail, limit = host_available()
    if not device.startswith("cuda"):
        return Machine(avail, None, f"this machine ({limit}), device {device}")
    import torch

    free, total = torch.cuda.mem_get_info(cuda_index(device))
    return Machine(
        avail, free, f"this machine ({limit}), {device} with {fmt_bytes(free)} of {fmt_bytes(total)} free"
    )


def given_machine(host_gib: float, device_gib: float) -> Machine:
    if not all(math.isfinite(g) and g > 0 for g in (host_gib, device_gib)):  # nan, inf: no machine
        raise InputError(
            f"--host-gib/--device-gib: give both, as positive finite numbers of GiB (got {host_gib:g}, {device_gib:g})"
        )
    host, dev = int(host_gib * 2**30), int(device_gib * 2**30)
    return Machine(host, dev, f"a machine with {fmt_bytes(host)} of RAM and a {fmt_bytes(dev)} CUDA device")
