"""Which AdamW implementation runs: the fused native kernel (optim.native) or the torch reference."""

from __future__ import annotations

from types import SimpleNamespace

from . import adamw as torch_adamw
from . import lean

# The pure-torch references, under the names optim.native gives its kernels.
TORCH = SimpleNamespace(
    adamw_fp32_=torch_adamw.adamw_fp32_, adamw_split_=torch_adamw.adamw_split_, adamw_lean_=lean.adamw_lean_
)


def pick_kernel(kind: str):
    """-> (object with adamw_fp32_/adamw_split_/adamw_lean_, name, note). kind: auto | torch | native."""
    if kind == "torch":
        return TORCH, "torch", ""
    from . import native

    why = "" if native.available() else native.reason()
    if not why:
        return native, "native", ""
    if kind == "native":
        from ..errors import InputError

        raise InputError(f"optim.kernel: native AdamW kernel unavailable ({why})")
    return TORCH, "torch", f"native AdamW kernel unavailable, using the torch path ({why})"
