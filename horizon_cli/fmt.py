"""How numbers are written for people: bytes in binary units, losses."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def fmt_loss(x: float | None) -> str:
    """A loss for people: 4 decimals (5.6559), or 4 significant digits once it is below 0.01
    (0.0002022, 3.141e-06), where 4 decimals would show 0.0002 or 0.0000; 'n/a' for None."""
    if x is None:
        return "n/a"
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    return f"{x:.4f}" if x == 0 or abs(x) >= 0.01 else f"{x:.4g}"
