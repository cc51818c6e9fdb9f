"""Regenerate the pictures in README.md and docs/ from real runs of the demo config:

    .venv/bin/python scripts/readme_images.py      (after `make demo` has built the store)

docs/img/progress.svg  the terminal after `horizon train configs/demo.yaml` (run in tmux, captured)
docs/img/loss.png      the loss curve that run writes
docs/img/timeline.png  `horizon profile --plot` of the same model and batch shape
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.text import Text

from horizon_cli.profile import run_profile

REPO = Path(__file__).resolve().parent.parent
IMG = REPO / "docs" / "img"
WIDTH, HEIGHT = 112, 40


def capture_training(run: Path) -> str:
    """Run the demo training in a real (tmux) terminal; return the screen with its colours."""
    session = f"horizon-readme-{os.getpid()}"
    horizon = f"{sys.executable} -m horizon_cli.cli"
    cmd = (
        f"{horizon} train configs/demo.yaml output.dir={run} output.export=false; tmux wait-for -S {session}"
    )
    tmux = ["tmux", "-L", session]
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", session, "-x", str(WIDTH), "-y", str(HEIGHT)], check=True
    )
    try:
        subprocess.run(
            [*tmux, "send-keys", "-t", session, f"cd {REPO} && clear && {cmd}", "Enter"], check=True
        )
        subprocess.run([*tmux, "wait-for", session], check=True, timeout=1800)
        time.sleep(0.5)
        out = subprocess.run(
            [*tmux, "capture-pane", "-p", "-e", "-t", session, "-S", "-200"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)


def main() -> None:
    os.chdir(REPO)  # the demo config's paths are relative to the checkout
    IMG.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        screen = capture_training(run)
        lines = [ln for ln in screen.rstrip().splitlines() if "$ " not in ln or "horizon" in ln]
        console = Console(record=True, width=WIDTH, force_terminal=True, file=open(os.devnull, "w"))  # noqa: SIM115
        console.print(Text("$ horizon train configs/demo.yaml", style="bold"))
        for ln in lines:
            if ln.strip() and "cli train" not in ln and "@" not in ln.split(" ")[0]:
                console.print(Text.from_ansi(ln), no_wrap=True, crop=True)
        console.save_svg(str(IMG / "progress.svg"), title="horizon train configs/demo.yaml")
        shutil.copyfile(run / "loss.png", IMG / "loss.png")
        run_profile(REPO / "configs" / "demo.yaml", plot=IMG / "timeline.png", console=Console())
    print(f"wrote {IMG}/progress.svg, loss.png, timeline.png")


if __name__ == "__main__":
    main()
