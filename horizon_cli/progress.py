"""Progress display helpers shared by the commands (rich; silent when no console is given)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Column


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


def train_columns(total_steps: int, fields: str) -> tuple[ProgressColumn, ...]:
    """The training bar: label, bar, step/total, elapsed, ETA, then `fields` (a TextColumn
    template). Narrow terminals cut the fields, never the counts or times: those columns keep
    their full width and the fields column alone shrinks, ending in an ellipsis."""

    def fixed(n: int) -> Column:
        return Column(no_wrap=True, min_width=n)

    return (
        TextColumn("[bold]train", table_column=fixed(5)),
        BarColumn(bar_width=12),
        MofNCompleteColumn(table_column=fixed(2 * len(str(total_steps)) + 1)),
        TimeElapsedColumn(table_column=fixed(7)),
        TimeRemainingColumn(table_column=fixed(7)),
        TextColumn(fields, table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
    )
