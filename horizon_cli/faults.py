"""Fault injection and phase tracing for crash tests (tests/train/test_train_resume.py, the soak).

Commands mark their phases with `phase(name, step)`: start-up, each training step, checkpoint
writes, pruning, export, and each sweep of an RL step's rollout decode (`rollout`, the step's
number; 0 for eval's). Two environment variables turn the marks into test hooks:

  HORIZON_FAULT=point[:step][+ms]   SIGKILL this process at `point` (at training step `step`
                                    only, when given); with `+ms`, that many milliseconds after
                                    reaching it, from a timer thread, so the kill lands at a
                                    random moment inside whatever follows the point
                                    (`mark` points too: `layer-grad`, inside the backward)
  HORIZON_FAULT_RANK=r              in a run under torchrun: only rank r obeys HORIZON_FAULT
  HORIZON_NAN_GRAD=unit[:step]      put a NaN into a layer's trained unit's gradient sum (layer.3;
                                    lora.3, its adapters, in a LoRA run) as the backward finishes
                                    it, at optimizer step `step` only (counting from 1, the step
                                    `adam_step` becomes), when given
  HORIZON_PHASES=file               append "name step time" to `file` at every mark (step "-"
                                    when none; time.monotonic()), so a test can tell where an
                                    outside kill landed: in the phase of the last line written

Unset, a mark costs one string test.
"""

from __future__ import annotations

import os
import signal
import threading
import time

_SPEC = os.environ.get("HORIZON_FAULT", "")
if os.environ.get("HORIZON_FAULT_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
    _SPEC = ""  # another rank's fault
_PHASES = os.environ.get("HORIZON_PHASES", "")
_NAN_GRAD = os.environ.get("HORIZON_NAN_GRAD", "")


def phase(name: str, step: int | None = None) -> None:
    if _PHASES:
        fd = os.open(_PHASES, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{name} {'-' if step is None else step} {time.monotonic():.4f}\n".encode())
        finally:
            os.close(fd)
    if _SPEC:
        _maybe_die(name, step)


def mark(name: str, step: int | None = None) -> None:
    """A fault point that writes no phase line (HORIZON_PHASES): inside a step, where a line per
    unit would only crowd the trace. `layer-grad`: a layer's gradient sum is whole (a release run:
    its update just queued behind the head's), the engine's backward still running."""
    if _SPEC:
        _maybe_die(name, step)


def nan_grad(unit: str, step: int) -> bool:
    """Whether HORIZON_NAN_GRAD asks for a NaN in `unit`'s gradient at optimizer step `step`."""
    if not _NAN_GRAD:
        return False
    name, _, at = _NAN_GRAD.partition(":")
    return name == unit and (not at or int(at) == step)


def _maybe_die(point: str, step: int | None = None) -> None:
    if not _SPEC:
        return
    where, _, delay = _SPEC.partition("+")
    name, _, at = where.partition(":")
    if name != point or (at and step is not None and int(at) != step):
        return
    ms = float(delay or 0)
    if ms <= 0:
        _kill()
    t = threading.Timer(ms / 1000, _kill)
    t.daemon = True
    t.start()


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
