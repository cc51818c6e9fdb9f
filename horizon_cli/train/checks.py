"""The checks a start of `horizon train` makes once its run is planned, in the order it makes them.
The start (train/run.py, train/loop.py) and the dry run (train/report.py) call these same
functions in this same order, so a dry run stops exactly where the start would, with its line:

    before_claim   the fit (host and device; a dry run for another machine: that machine's) of
                   the plan with its kept layers (engine.keep_activations: the K decided for
                   `where`, their weights and graphs; a number that does not fit is refused
                   naming the key), then TensorBoard, W&B, MLflow installed when log: asks for them
    the run dir    RunDir.claim (start) / RunDir.probe (dry run), same checks, same lines: not a
                   directory, not writable, in use, which checkpoint resumes and whether this
                   config may resume it. A run dir trained to train.steps stops here (nothing to
                   train; it is only finished), without the two checks below
    the data       read and tokenized (start: through <run>/cache; dry run: not cached), and
                   whether it goes with the config's training method (recipes.registry.checked:
                   e.g. preference pairs and a preference: section only together)
    kernel_ready   the native AdamW kernel: built now, as a phase of its own, when this machine has
                   no build yet (a minute, once), so the build is never part of a step's time or
                   the ETA; `optim.kernel: native` on a machine that cannot build it stops here

Then the start loads the weights (or the checkpoint), which checks every checksum.
"""

from __future__ import annotations

import time

from rich.console import Console

from ..engine.build import Planned, check_fit
from ..planning.fit import Machine
from ..planning.ladder import check_fits, not_applicable
from .metrics import tensorboard_writer
from .trackers import check_trackers


def before_claim(planned: Planned, where: Machine, local: bool = True) -> None:
    """local: `where` is this machine (its device's free memory is checked too). `planned` was
    planned for `where` (engine.build.plan_run), so its kept layers are the start's."""
    if local:
        check_fit(planned, where)
    else:  # --host-gib/--device-gib: the plan against that machine, not against this one's device
        check_fits(planned.rungs, planned.rung, where, not_applicable(planned.model))
    if planned.cfg.log.tensorboard:
        tensorboard_writer(None)  # fail now, not after loading the model
    check_trackers(planned.cfg)  # log.wandb, log.mlflow


def kernel_ready(kind: str, console: Console, build: bool = True) -> None:
    """kind: optim.kernel (auto | native | torch). build=False (a dry run): build only for
    `native`, the one kind a build that fails stops (auto falls back to the torch path, warned
    about when the engine is built)."""
    if kind == "torch" or (not build and kind != "native"):
        return
    from ..optim import native
    from ..optim.kernel import pick_kernel

    if native.needs_build():
        console.print(
            f"native AdamW kernel: building it (once for this machine and torch; cached in {native.cache_dir()})",
            highlight=False,
        )
        t0 = time.perf_counter()
        with console.status("building the native AdamW kernel"):
            ok = native.available()
        if ok:
            console.print(f"native AdamW kernel: built in {time.perf_counter() - t0:.1f} s", highlight=False)
    pick_kernel(kind)  # native unavailable: the engine's own InputError, now
