"""How many layers a start of `horizon train` keeps (engine.keep_activations), printed.

The plan decided K for this machine (planning.keep). With `auto`, a resumed run keeps the K its
checkpoint recorded (trainer.json `kept_layers`) while that still fits: the plan's K is the most
that does, so a smaller recorded K is kept, a larger one gives way to the plan's. The model is the
same either way (a kept layer's graph is the one recompute builds); the memory and the loads per
step stay those the run began with. A sharded run's ranks take the least of their Ks: their loads,
and the collectives that follow them, must pair up.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from ..config import Config
from ..engine.ranks import OneProcess, Ranks
from ..planning.release import step_passes
from ..store import ckpt


def kept_layers(
    planned: int,
    cfg: Config,
    ck: Path | None,
    ranks: Ranks | None,
    layers: int,
    console: Console,
    calls: int | None = None,
) -> int:
    """calls: the layer calls of a step's forward (a loop, arch.calls: more than `layers`)."""
    k, setting = planned, cfg.engine.keep_activations
    why = "auto: as many as fit" if setting == "auto" else f"engine.keep_activations: {setting}"
    if ck is not None and setting == "auto":
        try:
            recorded = ckpt.read_trainer(ck).get("kept_layers")
        except (OSError, ValueError):  # a damaged checkpoint: the engine's load names it
            recorded = None
        if recorded is not None and recorded <= k:
            k, why = recorded, f"auto: as the run began; {planned} would fit"
        elif recorded is not None:
            why = f"auto: as many as fit; the run began with {recorded}"
    k = (ranks or OneProcess()).fewest(k)  # sharded: the least of every rank's (None: one process)
    two = ", two passes: norm-first" if step_passes(cfg) > 1 else ""
    console.print(
        f"keep_activations: {k} of {layers} layers kept from forward to backward "
        f"({step_passes(cfg) * (2 * (calls or layers) - k)} layer loads per step{two}; {why})",
        highlight=False,
    )
    return k
