"""The fused C++ AdamW kernel (kernels/adamw.cpp), built on first use. Optimize stage.

Same calls as the pure-torch reference in optim.adamw, over the same flat buffers, one pass per
element. The moments come out bitwise equal to the reference's; the master differs from it by a few
ulps at most, only because the kernel's sqrt is correctly rounded and torch's (MKL) is not (see
tests/test_kernel_adamw.py). Nothing here raises on a machine that cannot build the kernel:
`available()` says whether it loaded and `reason()` why not, and callers fall back to optim.adamw.

The extension is compiled once with torch.utils.cpp_extension and cached under
$TORCH_EXTENSIONS_DIR/horizon, else $XDG_CACHE_HOME/horizon/kernels (~/.cache/horizon/kernels).
Its module name carries a hash of the sources, the flags and the torch/Python versions, so a
changed source or a new torch builds afresh and never loads a stale library.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import shutil
import sys
import threading
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import ModuleType

import torch

from .adamw import AdamWHyper

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
SOURCES = ("adamw.cpp", "adamw_impl.h")  # all of them hashed; adamw.cpp is the one compiled
# -ffp-contract=off is part of the contract: the kernel must round like torch (see adamw.cpp).
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)
_STALE_LOCK_S = 600  # a build takes well under a minute; an older lock was left by a killed build

_lock = threading.Lock()
_module: ModuleType | None = None
_reason: str | None = None  # None: not tried yet; "": loaded


def available() -> bool:
    """Build or load the kernel on first call; False (and `reason()`) if it cannot. Never raises."""
    global _module, _reason
    with _lock:
        if _reason is None:
            try:
                _module, _reason = _load(), ""
            except Exception as e:  # any failure means "use the torch path", reported by reason()
                _reason = _first_line(str(e)) or type(e).__name__
    return _module is not None


def reason() -> str:
    """Why the kernel is unavailable ("" when it is available)."""
    available()
    return _reason or ""


def isas() -> list[str]:
    """Instruction-set paths this CPU supports, best first: a subset of avx512, avx2, scalar."""
    return list(_ext().isas())


def adamw_fp32_(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: AdamWHyper, *, isa: str = "auto"
) -> None:
    """optim.adamw.adamw_fp32_ in one fused pass.  All (N,) contiguous fp32.

    `isa` forces a path ("avx512", "avx2", "scalar"); all give identical bits.
    """
    _ext().adamw_fp32(p, g, m, v, *_scalars(h), isa=isa)


def adamw_split_(
    hi: torch.Tensor,
    lo: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    h: AdamWHyper,
    *,
    isa: str = "auto",
) -> None:
    """optim.adamw.adamw_split_ in one fused pass: bf16 `hi`, int16 `lo`, fp32 g, m, v, all (N,)."""
    _ext().adamw_split(hi, lo, g, m, v, *_scalars(h), isa=isa)


def _scalars(h: AdamWHyper) -> tuple[float, float, float, float, float, int, float]:
    return (h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, int(h.step), h.grad_scale)


def _ext() -> ModuleType:
    if _module is not None:  # the per-unit hot path: no lock once loaded
        return _module
    if not available():
        raise RuntimeError(f"native AdamW kernel unavailable: {reason()}")
    assert _module is not None
    return _module


def _first_line(text: str) -> str:
    """The compiler's first `error:` line if there is one, else the first non-empty line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return next((ln for ln in lines if "error:" in ln), lines[0] if lines else "")


def _build_root() -> Path:
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "horizon"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "horizon" / "kernels"


def _module_name() -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (KERNEL_DIR / name).read_bytes() + b"\0")
    digest.update(repr((CFLAGS, LDFLAGS, torch.__version__, sys.version_info[:2])).encode())
    return f"horizon_adamw_{digest.hexdigest()[:16]}"


def _load() -> ModuleType:
    missing = [n for n in SOURCES if not (KERNEL_DIR / n).is_file()]
    if missing:
        raise FileNotFoundError(f"kernel source missing: {KERNEL_DIR / missing[0]}")
    name = _module_name()
    build_dir = _build_root() / name
    done = build_dir / "loaded-ok"  # written once a build has been imported successfully
    if done.is_file():  # fast path: skips ninja and the compiler checks (~1 s) in later processes
        return _import_library(name, build_dir / f"{name}.so")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not on PATH)")
    build_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build_dir / "lock")
    from torch.utils.cpp_extension import load

    # cpp_extension logs through Python; keep a successful build silent.
    sink = io.StringIO()
    with redirect_stdout(sink), redirect_stderr(sink):
        module = load(
            name=name,
            sources=[str(KERNEL_DIR / "adamw.cpp")],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir),
            verbose=False,
        )
    # Only now: a library left half-written by a killed build must never take the fast path
    # (dlopen of a truncated file dies with SIGBUS instead of raising).
    done.touch()
    return module


def _import_library(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _clear_stale_lock(lock: Path) -> None:
    """torch waits forever on a lock file left by a killed build; drop one that is clearly stale."""
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
    except FileNotFoundError:
        pass
