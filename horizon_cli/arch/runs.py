"""transformers' checkpoint conversion operations, followed symbolically: which disk elements each
in-memory element is.

A tensor here is a shape and its *runs*: the row-major elements as consecutive ranges of disk
tensors, (disk name, first element, count). A disk tensor as read is one run; stacking,
concatenating, splitting and chunking along any dimension only reorder and regroup runs, so an
operation chain of those is computed on the runs alone (no data, whatever the tensors' sizes). The
result says where every disk tensor's elements sit inside the in-memory tensors, from which
arch.disk decides whether the store can hold them as views.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

MAX_RUNS = 1 << 20  # a chain that shreds its tensors finer than this is not a view anyway


class Unsupported(Exception):
    """An operation that is not a reordering of whole runs, or a chain too fragmented to follow."""


class ShapeError(Exception):
    """Operands whose shapes the operation cannot combine (a misshapen disk tensor)."""

    def __init__(self, odd: Sym, want: tuple[int | str, ...] | str):
        super().__init__(f"shape {odd.shape}, expected {want}")
        self.odd, self.want = odd, want


@dataclass
class Sym:
    shape: tuple[int, ...]
    runs: list[tuple[str, int, int]]  # (disk name, first element, count), in row-major order
    _starts: list[int] = field(default_factory=list, repr=False)

    @staticmethod
    def leaf(name: str, shape: tuple[int, ...]) -> Sym:
        n = math.prod(shape)
        return Sym(tuple(shape), [(name, 0, n)] if n else [])

    def names(self) -> list[str]:
        return list(dict.fromkeys(r[0] for r in self.runs))

    def flat(self, a: int, b: int) -> list[tuple[str, int, int]]:
        """The runs of elements [a, b)."""
        if not self._starts:
            pos, self._starts = 0, []
            for r in self.runs:
                self._starts.append(pos)
                pos += r[2]
        out = []
        k = max(0, bisect.bisect_right(self._starts, a) - 1)
        while a < b and k < len(self.runs):
            name, first, count = self.runs[k]
            s = self._starts[k]
            lo, hi = max(a, s), min(b, s + count)
            if hi > lo:
                out.append((name, first + lo - s, hi - lo))
            k += 1
            if s + count >= b:
                break
        return out


def coalesce(runs: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Adjacent runs of one disk tensor that continue each other, merged."""
    out: list[tuple[str, int, int]] = []
    for r in runs:
        if out and out[-1][0] == r[0] and out[-1][1] + out[-1][2] == r[1]:
            out[-1] = (r[0], out[-1][1], out[-1][2] + r[2])
        else:
            out.append(r)
    if len(out) > MAX_RUNS:
        raise Unsupported("its pieces are too fragmented to follow")
    return out


def _dim(d: int, ndim: int) -> int:
    if not -ndim <= d < max(ndim, 1):
        raise Unsupported(f"dimension {d} of a {ndim}-d tensor")
    return d % ndim


def cat(syms: list[Sym], dim: int) -> Sym:
    """torch.cat along dim."""
    if not syms:
        raise Unsupported("nothing to concatenate")
    ref = max((s.shape for s in syms), key=[s.shape for s in syms].count)
    d = _dim(dim, len(ref))
    for s in syms:
        if len(s.shape) != len(ref) or s.shape[:d] + s.shape[d + 1 :] != ref[:d] + ref[d + 1 :]:
            raise ShapeError(s, ref[:d] + ("*",) + ref[d + 1 :])
    outer = math.prod(ref[:d])
    if outer * len(syms) > MAX_RUNS:
        raise Unsupported("its pieces are too fragmented to follow")
    runs = []
    for o in range(outer):
        for s in syms:
            block = math.prod(s.shape[d:])
            runs += s.flat(o * block, (o + 1) * block)
    shape = ref[:d] + (sum(s.shape[d] for s in syms),) + ref[d + 1 :]
    return Sym(shape, coalesce(runs))


def stack(syms: list[Sym], dim: int) -> Sym:
    """torch.stack along dim."""
    if not syms:
        raise Unsupported("nothing to stack")
    ref = max((s.shape for s in syms), key=[s.shape for s in syms].count)
    for s in syms:
        if s.shape != ref:
            raise ShapeError(s, ref)
    d = _dim(dim, len(ref) + 1)
    return cat([Sym(s.shape[:d] + (1,) + s.shape[d:], s.runs) for s in syms], d)


def narrow(s: Sym, dim: int, start: int, length: int) -> Sym:
    """s.narrow(dim, start, length)."""
    d = _dim(dim, len(s.shape))
    outer, inner = math.prod(s.shape[:d]), math.prod(s.shape[d + 1 :])
    if outer > MAX_RUNS:
        raise Unsupported("its pieces are too fragmented to follow")
    row = s.shape[d] * inner
    runs = []
    for o in range(outer):
        runs += s.flat(o * row + start * inner, o * row + (start + length) * inner)
    return Sym(s.shape[:d] + (length,) + s.shape[d + 1 :], coalesce(runs))


def split(s: Sym, dim: int, sizes: list[int]) -> list[Sym]:
    """torch.split with a list of sizes."""
    d = _dim(dim, len(s.shape))
    if sum(sizes) != s.shape[d]:
        raise ShapeError(s, s.shape[:d] + (sum(sizes),) + s.shape[d + 1 :])
    out, at = [], 0
    for n in sizes:
        out.append(narrow(s, d, at, n))
        at += n
    return out


def chunk(s: Sym, dim: int, k: int) -> list[Sym]:
    """torch.chunk: pieces of ceil(n / k) along dim, the last smaller (and fewer pieces if so)."""
    d = _dim(dim, len(s.shape))
    n = s.shape[d]
    step = -(-n // k) if k else n
    return split(s, d, [min(step, n - a) for a in range(0, n, step)] if step else [])
