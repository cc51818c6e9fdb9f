"""Progress display helpers shared by the commands (rich; silent when no console is given)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


@contextlib.contextmanager
def byte_progress(console: Console | None, label: str, total: int) -> Iterator[Callable[[int], None]]:
    """Yield `advance(nbytes)`; shows bytes done, bytes/s and ETA when a console is given."""
    if console is None:
        yield lambda n: None
        return
    cols = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*cols, console=console, transient=False) as prog:
        task = prog.add_task(label, total=total)
        yield lambda n: prog.advance(task, n)
