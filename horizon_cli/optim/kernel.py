"""Which AdamW implementation runs: the fused native kernel (optim.native) or the torch reference."""

from __future__ import annotations

from . import adamw as torch_adamw


def pick_kernel(kind: str):
    """-> (module with adamw_fp32_/adamw_split_, name, note). kind: auto | torch | native."""
    if kind == "torch":
        return torch_adamw, "torch", ""
    from . import native

    why = "" if native.available() else native.reason()
    if not why:
        return native, "native", ""
    if kind == "native":
        from ..errors import InputError

        raise InputError(f"optim.kernel: native AdamW kernel unavailable ({why})")
    return torch_adamw, "torch", f"native AdamW kernel unavailable, using the torch path ({why})"
