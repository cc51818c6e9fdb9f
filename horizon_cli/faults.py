"""Fault injection for crash tests: `HORIZON_FAULT=point[:step]` kills the process with SIGKILL
when it reaches that point (and, with :step, only at that training step). Costs one dict lookup."""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("HORIZON_FAULT", "")


def maybe_die(point: str, step: int | None = None) -> None:
    if not _SPEC:
        return
    name, _, at = _SPEC.partition(":")
    if name == point and (not at or step is None or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)
