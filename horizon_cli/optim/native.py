"""The fused C++ AdamW kernel (kernels/adamw.cpp), built on first use. Optimize stage.

Same calls as the pure-torch reference in optim.adamw, over the same flat buffers, one pass per
element. The moments come out bitwise equal to the reference's; the master differs from it by a few
ulps at most, only because the kernel's sqrt is correctly rounded and torch's (MKL) is not (see
tests/optim/test_kernel_adamw.py). Nothing here raises on a machine that cannot build the kernel:
`available()` says whether it loaded and `reason()` why not, and callers fall back to optim.adamw.

The extension is compiled once with torch.utils.cpp_extension and cached under
$TORCH_EXTENSIONS_DIR/horizon, else $XDG_CACHE_HOME/horizon/kernels (~/.cache/horizon/kernels).
Its module name carries a hash of the sources, the flags and the torch/Python versions, so a
changed source or a new torch builds afresh and never loads a stale library. Each process builds
in a private, owner-named directory and publishes it by one rename, so a build killed midway
never leaves a lock for later runs to wait on (they sweep it and build again), and a build that
cannot finish makes `available()` False: the optimizer falls back to the torch path and the
trainer prints a warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import shutil
import sys
import threading
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import ModuleType

import torch

from .. import owner
from .adamw import AdamWHyper

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
SOURCES = ("adamw.cpp", "adamw_impl.h")  # all of them hashed; adamw.cpp is the one compiled
# -ffp-contract=off is part of the contract: the kernel must round like torch (see adamw.cpp).
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)
DONE = "loaded-ok"  # in a published build dir: the library was built and imported successfully

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


def needs_build() -> bool:
    """available() would compile (a minute): not tried in this process, and no build on this
    machine yet. The trainer shows the build as a phase of its own (train/checks.py)."""
    if _reason is not None:
        return False
    try:
        return not (_build_root() / _module_name() / DONE).is_file()
    except OSError:  # a source missing: available() says so, at once
        return False


def cache_dir() -> Path:
    """Where builds are kept (one per source hash, torch and Python version)."""
    return _build_root()


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


def adamw_lean_(
    hi: torch.Tensor,
    lo8: torch.Tensor,
    g: torch.Tensor,
    qm: torch.Tensor,
    qw: torch.Tensor,
    sm: torch.Tensor,
    sw: torch.Tensor,
    h: AdamWHyper,
    seed: int = 0,
    base: int = 0,
    *,
    isa: str = "auto",
) -> None:
    """optim.lean.adamw_lean_ in one pass over blocks of 64: bitwise equal to it on every path."""
    _ext().adamw_lean(hi, lo8, g, qm, qw, sm, sw, *_scalars(h), seed=seed, base=base, isa=isa)


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
    root = _build_root()
    final = root / name
    if (final / DONE).is_file():  # fast path: skips ninja and the compiler checks (~1 s)
        return _import_library(name, final / f"{name}.so")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not on PATH)")
    root.mkdir(parents=True, exist_ok=True)
    owner.sweep(root)  # private build dirs of builds that were killed
    build = root / owner.temp_name(name, "build")
    try:
        os.mkdir(build)
        module = _compile(name, build)
        (build / DONE).touch()
        _publish(build, final)
    finally:
        owner.remove(build)  # gone already when published
    return module


def _compile(name: str, build: Path) -> ModuleType:
    """Build and import the extension in `build`, a directory private to this process: a build
    killed midway leaves only an owner-named dir that the next build sweeps, never a lock or a
    half-written library where other processes look."""
    from torch.utils.cpp_extension import load

    # cpp_extension logs through Python; keep a successful build silent.
    sink = io.StringIO()
    with redirect_stdout(sink), redirect_stderr(sink):
        return load(
            name=name,
            sources=[str(KERNEL_DIR / "adamw.cpp")],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build),
            verbose=False,
        )


def _publish(build: Path, final: Path) -> None:
    """Rename the finished build to its shared name in one step. Another process may have
    published first (keep theirs); a directory there without the DONE marker is left from an
    older layout or a killed build, and is replaced."""
    if final.exists() and not (final / DONE).is_file():
        aside = final.with_name(owner.temp_name(final.name, "del"))
        with contextlib.suppress(FileNotFoundError):
            os.rename(final, aside)
        owner.remove(aside)
    with contextlib.suppress(OSError):  # ENOTEMPTY/EEXIST: a concurrent build won; same bytes
        os.rename(build, final)


def _import_library(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
