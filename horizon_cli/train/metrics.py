"""Run outputs besides checkpoints: metrics.jsonl, optional TensorBoard, the loss-curve PNG."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from .. import owner
from ..errors import HorizonError, InputError
from ..fsutil import write_text_atomic


class MetricsLog:
    """Appends one JSON object per optimizer step. On resume it keeps exactly the lines of steps
    up to the checkpoint's, by step number: a line garbled by a crash is dropped (and counted),
    never the history after it."""

    def __init__(self, run_dir: Path, resume_step: int, tensorboard: bool, console=None, trackers=None):
        """trackers: experiment trackers (train.trackers.Trackers) that get every row too."""
        self.path = Path(run_dir) / "metrics.jsonl"
        rows, bad = read_metrics_counted(self.path)
        kept = [r for r in rows if r.get("step", 0) <= resume_step] if resume_step else []
        if bad and console is not None:
            console.print(
                f"[yellow]warning:[/] {self.path}: dropped {bad} unreadable line(s)", highlight=False
            )
        with io_failure(self.path):
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
            self.f = open(self.path, "a")  # noqa: SIM115 - held open for the whole run
        # a resumed run retrains the steps after its checkpoint that a killed run had logged: TensorBoard
        # hides those events (its purge_step), so each step is shown once, with the resumed run's values
        tb_dir = Path(run_dir) / "tensorboard"
        self.tb = (
            tensorboard_writer(tb_dir, resume_step + 1 if resume_step else None) if tensorboard else None
        )
        self.trackers = trackers

    def write(self, row: dict) -> None:
        with io_failure(self.path):
            self.f.write(json.dumps(row) + "\n")
            self.f.flush()
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, int | float) and not isinstance(v, bool) and k != "step":
                    self.tb.add_scalar(k, v, row["step"])
        if self.trackers is not None:
            self.trackers.log(row)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a failed flush was already reported by write()
            self.f.close()
        if self.tb is not None:
            self.tb.close()
        if self.trackers is not None:
            self.trackers.close()


@contextlib.contextmanager
def io_failure(path: Path) -> Iterator[None]:
    """A failed write of a run output (disk full, file too large) is one line naming the file,
    exit status 1."""
    try:
        yield
    except OSError as e:
        raise HorizonError(f"{path}: {e.strerror or e}") from None


def read_metrics(path: Path) -> list[dict]:
    return read_metrics_counted(path)[0]


def read_metrics_counted(path: Path) -> tuple[list[dict], int]:
    """(rows that parse as JSON objects with a step, number of lines that do not)."""
    if not Path(path).is_file():
        return [], 0
    rows, bad = [], 0
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        elif line.strip():
            bad += 1
    return rows, bad


def tensorboard_writer(logdir: Path | None, purge_step: int | None = None):
    """A SummaryWriter for logdir (None: only check that TensorBoard is installed). purge_step: the
    first step this run logs; events a killed run wrote at it or later are hidden from TensorBoard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise InputError("log.tensorboard: needs the tensorboard package (pip install tensorboard)") from None
    return SummaryWriter(str(logdir), purge_step=purge_step) if logdir is not None else None


def plot_loss(rows: list[dict], out: Path, title: str = "") -> Path | None:
    """Loss (and eval loss) against step, with the learning rate on a second axis; a preference
    run's reward accuracy (train, eval) in a panel below."""
    rows = [r for r in rows if r.get("loss") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pref = any(r.get("rewards_accuracy") is not None for r in rows)
    if pref:
        fig, (ax, acc_ax) = plt.subplots(2, 1, figsize=(8, 6.5), dpi=110, sharex=True, height_ratios=(2, 1))
        _plot_accuracy(acc_ax, rows)
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], color="#1f77b4", lw=1.6, label="train loss")
    ev = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if ev:
        ax.plot(*zip(*ev, strict=True), "o-", color="#d62728", lw=1.2, ms=4, label="eval loss")
    if not pref:
        ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, [r["lr"] for r in rows], color="#7f7f7f", lw=1, ls="--", label="lr")
    lr_ax.set_ylabel("learning rate", color="#7f7f7f")
    lines = ax.get_legend_handles_labels()
    lr_lines = lr_ax.get_legend_handles_labels()
    ax.legend(lines[0] + lr_lines[0], lines[1] + lr_lines[1], loc="upper right")
    ax.set_title(title or "horizon training")
    fig.tight_layout()
    out = Path(out)
    tmp = out.with_name(owner.temp_name(out.name))
    try:
        with io_failure(out):
            fig.savefig(tmp, format="png")
            os.replace(tmp, out)
    finally:
        plt.close(fig)
        with contextlib.suppress(OSError):
            tmp.unlink()
    return out


def _plot_accuracy(ax, rows: list[dict]) -> None:
    """rewards_accuracy (chosen rewarded above rejected) per step, and at each evaluation."""
    tr = [(r["step"], r["rewards_accuracy"]) for r in rows if r.get("rewards_accuracy") is not None]
    ax.plot(*zip(*tr, strict=True), color="#2ca02c", lw=1.4, label="train rewards accuracy")
    ev = [(r["step"], r["eval_rewards_accuracy"]) for r in rows if r.get("eval_rewards_accuracy") is not None]
    if ev:
        ax.plot(*zip(*ev, strict=True), "o-", color="#d62728", lw=1.2, ms=4, label="eval rewards accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
