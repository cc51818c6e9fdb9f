"""Import noise of torch/torchao is silenced at its source, and nothing else is (horizon_cli/quiet.py).

transformers imports torchao whenever it is installed; on a CPU-only torch torchao then logs
"Failed to load ..._C_mxfp8...so: Could not load this library" and torch's pytree logs "<enum
'KernelPreference'> is an Enum subclass ...", on every generic-path (MoE) run. In a fresh
interpreter, since each is logged once, at torchao's first import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

NOISY = (
    "import logging, warnings\n"
    "{setup}"
    "from transformers import modeling_utils  # imports transformers.quantizers, and torchao\n"
    "logging.getLogger('torchao').warning('torchao says something else')\n"
    "logging.getLogger('torch.utils._pytree').warning('pytree says something else')\n"
    "warnings.warn('a warning of anyone else')\n"
)


def stderr_of(setup: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-c", NOISY.format(setup=setup)], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_torchao_import_noise_is_dropped_and_nothing_else():
    pytest.importorskip("torchao")
    out = stderr_of("import horizon_cli\n")
    assert "Failed to load" not in out and "Could not load this library" not in out, out
    assert "is an Enum subclass" not in out, out
    for kept in ("torchao says something else", "pytree says something else", "a warning of anyone else"):
        assert kept in out, out


def test_the_filters_match_what_torchao_logs_here():
    """Without horizon_cli the same interpreter shows the noise (when this torchao makes it): the
    patterns in quiet.NOISE are checked against the real records, not only against themselves."""
    pytest.importorskip("torchao")
    from horizon_cli.quiet import NOISE

    out = stderr_of("")
    lines = [ln for ln in out.splitlines() if "Failed to load" in ln or "is an Enum subclass" in ln]
    if not lines:
        pytest.skip("this torchao loads its libraries and registers no enums: no noise to drop")
    for ln in lines:
        msg = ln.split("] ", 1)[1] if "_pytree.py" in ln else ln  # torch's log prefix: 'W... file:line] '
        assert any(p.match(msg) for p in NOISE.values()), ln
