"""Import-time log records of torch, torchao and bitsandbytes that read as breakage, silenced at their source.

transformers imports torchao whenever it is installed (`transformers.quantizers` does, and every
model class imports those), which happens on every generic-path run (MoE and the other families
built from transformers' classes), and at export. torchao then logs, through Python's logging:

    torchao               Failed to load .../torchao/_C_mxfp8...so: Could not load this library: ...
                          (CUDA kernels of a build for another torch; horizon never calls them)
    torch.utils._pytree   <enum 'KernelPreference'> is an Enum subclass and is now natively
                          supported by torch.compile ... (torchao registers its enums the old way)

and peft imports bitsandbytes, which on a CPU with AVX-512 BF16 asks the hub for a 4-bit GEMM
kernel at import and, offline or untrusted, logs

    bitsandbytes.backends.cpu.ops   Failed to load CPU gemm_4bit_forward from kernels-community: ...
                          (it falls back to its own; horizon never calls that GEMM: its NF4 is
                          its own, quant/nf4_bnb.py)
    kernels._internals.hf_hub       Skipping publisher trust check for 'kernels-community/
                          quantization-bitsandbytes' because Hugging Face Hub is in offline mode.
                          (the same attempt, with HF_HUB_OFFLINE set)

A newcomer reads "Could not load this library" as a broken install. Exactly those records are
dropped, by a filter on the logger that emits them; every other record of those loggers, and
every warning anywhere else, still shows. Installed when the package is imported (horizon_cli).
"""

from __future__ import annotations

import logging
import re

NOISE = {
    "torchao": re.compile(r"Failed to load \S*torchao[/\\]_C\S*\.so: "),
    "torch.utils._pytree": re.compile(r"<enum '\w+'> is an Enum subclass and is now natively supported"),
    "bitsandbytes.backends.cpu.ops": re.compile(
        r"Failed to load CPU gemm_4bit_forward from kernels-community: "
    ),
    "kernels._internals.hf_hub": re.compile(
        r"Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'"
    ),
}


class _Drop(logging.Filter):
    """Drops the records of one logger whose message matches `pattern` (from its start)."""

    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def silence_import_noise() -> None:
    for name, pattern in NOISE.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in log.filters):
            log.addFilter(_Drop(pattern))
