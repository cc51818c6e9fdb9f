"""The run dir in a sharded run: rank 0 owns it, the other ranks follow its decisions.

One lock per run dir, held by rank 0 (the run dir is on a file system every node sees: a shared
one when the ranks span nodes). Rank 0 claims it and picks the resume point as a single process
does, then tells the others which checkpoints are intact (or the error that stopped it, which
every rank then raises). Only rank 0 changes the run dir outside checkpoints: it sweeps, prunes,
writes config.yaml, metrics, the plot, the export and finished.json.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

from rich.console import Console

from ..config import Config
from ..errors import HorizonError, InputError
from ..parallel.comm import Dist
from ..store import Store
from .rundir import RunDir

T = TypeVar("T")


@contextlib.contextmanager
def claim(cfg: Config, store: Store, console: Console, d: Dist | None) -> Iterator[RunDir]:
    if d is None:
        with RunDir.claim(cfg, store, console) as rd:
            yield rd
        return
    if d.is_main:
        with contextlib.ExitStack() as stack:
            try:
                rd = stack.enter_context(RunDir.claim(cfg, store, console))
            except HorizonError as e:
                d.broadcast_object((type(e) is not HorizonError, str(e), []))
                raise
            d.broadcast_object((None, "", [str(p) for p in rd.candidates]))
            yield rd
        return
    bad, msg, candidates = d.broadcast_object(None)
    if bad is not None:
        raise (InputError if bad else HorizonError)(msg)
    rd = RunDir(cfg, store, console)
    rd.follower = True
    rd.candidates = [Path(p) for p in candidates]
    yield rd
