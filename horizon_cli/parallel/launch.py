"""Joining the world torchrun set up: WORLD_SIZE, RANK, LOCAL_RANK and the rendezvous address.

`torchrun --nproc-per-node N [--nnodes M --rdzv-...] -m horizon_cli train CONFIG` starts one
process per GPU; each finds its place here. Without WORLD_SIZE (or with WORLD_SIZE=1) a run is
the plain single-process run: no process group, no collectives. CUDA ranks use NCCL on
`cuda:LOCAL_RANK`; `engine.device: cpu` uses gloo (how the tests run several ranks on one CPU).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
from collections.abc import Iterator
from typing import NoReturn

from ..errors import InputError
from .comm import Dist

TIMEOUT_ENV = "HORIZON_DIST_TIMEOUT"  # seconds a collective may wait for a missing rank (default 600)


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise InputError(f"{name}={v!r}: expected an integer (set by torchrun)") from None


RENDEZVOUS = ("RANK", "MASTER_ADDR", "MASTER_PORT")  # what torch's env:// rendezvous reads


def world_from_env() -> tuple[int, int, int]:
    """(world, rank, local rank) that torchrun set; (1, 0, 0) for a plain run. A WORLD_SIZE > 1
    without the rest of torchrun's variables (one exported by mistake) is refused here: torch
    would raise a ValueError, or wait for ranks that never come."""
    world = _env_int("WORLD_SIZE") or 1
    rank = _env_int("RANK") or 0
    local = _env_int("LOCAL_RANK") or 0
    if world < 1 or not 0 <= rank < world:
        raise InputError(f"RANK={rank} is not in WORLD_SIZE={world}")
    if world > 1:
        for name in RENDEZVOUS:
            if not os.environ.get(name):
                raise InputError(
                    f"WORLD_SIZE={world} but {name} is not set: launch the ranks with torchrun "
                    f"(torchrun --nproc-per-node {world} -m horizon_cli ...), or unset WORLD_SIZE for one process"
                )
        dist_timeout()
    return world, rank, local


def dist_timeout() -> float:
    """Seconds a collective may wait for a missing rank (HORIZON_DIST_TIMEOUT, default 600)."""
    v = os.environ.get(TIMEOUT_ENV, "600")
    try:
        t = float(v)
    except ValueError:
        t = 0.0
    if not 0 < t < float("inf"):
        raise InputError(f"{TIMEOUT_ENV}={v!r}: expected a number of seconds > 0")
    return t


def rank_device(device: str, local_rank: int) -> str:
    """The device of this rank: `cuda:LOCAL_RANK` for auto or any CUDA device (one process per
    GPU: a configured index would put every rank of a node on one GPU), else the configured one."""
    if device == "auto" or device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return f"cuda:{local_rank}"
    return device


@contextlib.contextmanager
def joined(device: str) -> Iterator[Dist | None]:
    """Join the process group for the run's lifetime (None for a single process)."""
    world, rank, local = world_from_env()
    if world == 1:
        yield None
        return
    import torch
    import torch.distributed as dist

    timeout = dist_timeout()
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(device.split(":")[1]) if ":" in device else local)
    owned = not dist.is_initialized()  # a caller's group (several runs in one process) is kept
    if owned:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    d = Dist(world, rank, local, timeout)
    try:
        yield d
    finally:
        d.stop()
        if owned:
            with contextlib.suppress(Exception):  # a dead peer: nothing left to tear down cleanly
                dist.destroy_process_group()


def under_torchrun() -> bool:
    """This process is one rank of several (torchrun's WORLD_SIZE > 1)."""
    return (_env_int("WORLD_SIZE") or 1) > 1


def exit_rank(code: int) -> NoReturn:
    """End a rank's process once its work is done and its process group destroyed: the atexit
    handlers run and the standard streams are flushed while the interpreter is whole, then the
    process exits without the interpreter's teardown. In that teardown a rank that had finished
    (its files written, its group destroyed) sometimes aborted, SIGABRT with "terminate called
    without an active exception" from a C++ thread while no Python frame was left (twice in CI's
    slow tier, in two different 2-rank tests; never reproduced here in 127 launches), and torchrun
    then reports the whole run failed. Skipping the teardown leaves no such thread to meet."""
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
