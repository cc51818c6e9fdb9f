"""Import noise of torch/torchao is silenced at its source, and nothing else is (horizon_cli/quiet.py).

transformers imports torchao whenever it is installed; on a CPU-only torch torchao then logs
"Failed to load ..._C_mxfp8...so: Could not load this library" and torch's pytree logs "<enum
'KernelPreference'> is an Enum subclass ...", on every generic-path (MoE) run. Each is logged once,
at torchao's first import: so in a fresh interpreter, where a recorder placed before horizon's
filter sees every record the two loggers get, and stderr shows what the user would see."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, logging, warnings
import horizon_cli
seen = []
class Record(logging.Filter):
    def filter(self, record):
        seen.append(record.getMessage())
        return True
for name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(name).filters.insert(0, Record())  # before horizon's: sees what it drops
from transformers import modeling_utils  # imports transformers.quantizers, and with it torchao
logging.getLogger("torchao").warning("torchao says something else")
logging.getLogger("torch.utils._pytree").warning("pytree says something else")
warnings.warn("a warning of anyone else")
print(json.dumps(seen))
"""


def test_torchao_import_noise_is_dropped_and_nothing_else():
    pytest.importorskip("torchao")
    from horizon_cli.quiet import NOISE

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    noise = [m for m in seen if any(p.match(m) for p in NOISE.values())]
    for m in noise:  # what this torchao logs (none when it loads its libraries here)
        assert m.split(":")[0] not in r.stderr, r.stderr
    assert "Could not load this library" not in r.stderr and "is an Enum subclass" not in r.stderr, r.stderr
    assert [m for m in seen if m not in noise] == [
        "torchao says something else",
        "pytree says something else",
    ]
    for kept in ("torchao says something else", "pytree says something else", "a warning of anyone else"):
        assert kept in r.stderr, r.stderr


BNB = """
import logging
import horizon_cli
import peft  # imports bitsandbytes: on an AVX-512 BF16 CPU it asks the hub for a kernel here
log = logging.getLogger("bitsandbytes.backends.cpu.ops")
log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: as offline")  # as logged
log.warning("bitsandbytes says something else")
logging.getLogger("kernels._internals.hf_hub").warning(
    "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' because ..."
)
"""


def test_bitsandbytes_hub_kernel_noise_is_dropped_and_nothing_else():
    """peft imports bitsandbytes, whose CPU backend logs "Failed to load CPU gemm_4bit_forward
    from kernels-community" where the hub cannot be reached (every nf4 or resident rollout run
    here); it falls back to its own GEMM, which horizon does not call."""
    pytest.importorskip("bitsandbytes")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", BNB], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "Failed to load CPU gemm_4bit_forward" not in r.stderr, r.stderr
    assert "Skipping publisher trust check" not in r.stderr, r.stderr  # offline, the same attempt
    assert "bitsandbytes says something else" in r.stderr, r.stderr
