"""Regenerate the pictures in README.md from a real run of the demo config:

    .venv/bin/python scripts/readme_images.py      (after `make demo` has built the store)

docs/img/progress.svg  the terminal while `horizon train configs/demo.yaml` runs (rich, recorded)
docs/img/loss.png      the loss curve that run writes
docs/img/timeline.png  `horizon profile --plot` of the same model
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from rich.console import Console

from horizon_cli.profile import run_profile
from horizon_cli.train import run_training

REPO = Path(__file__).resolve().parent.parent
IMG = REPO / "docs" / "img"


def main() -> None:
    os.chdir(REPO)  # the demo config's paths are relative to the checkout
    IMG.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        console = Console(record=True, width=110, force_terminal=True)
        console.print("[bold]$ horizon train configs/demo.yaml")
        run_training(
            REPO / "configs" / "demo.yaml", [f"output.dir={run}", "output.export=false"], console=console
        )
        console.save_svg(str(IMG / "progress.svg"), title="horizon train configs/demo.yaml")
        shutil.copyfile(run / "loss.png", IMG / "loss.png")
        cfg = Path(tmp) / "profile.yaml"
        cfg.write_text((REPO / "configs" / "demo.yaml").read_text())
        run_profile(cfg, plot=IMG / "timeline.png", console=Console())
    print(f"wrote {IMG}/progress.svg, loss.png, timeline.png")


if __name__ == "__main__":
    main()
