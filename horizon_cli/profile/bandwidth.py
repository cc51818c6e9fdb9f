"""Link bandwidth: host -> device and device -> host, from pinned and pageable memory, by size.

On the CPU transport the "link" is a memcpy between two buffers (or the emulated link when
`engine.link_gbps` is set), and pinned and pageable are the same memory; the table says so.
"""

from __future__ import annotations

import time

import torch

SIZES = (1 << 20, 16 << 20, 256 << 20)


def measure(transport, sizes=SIZES, repeats: int = 3) -> list[dict]:
    rows = []
    for n in sizes:
        for pinned in (True, False):
            host = transport.host_empty(n, torch.uint8) if pinned else torch.empty(n, dtype=torch.uint8)
            host.fill_(1)
            dev = transport.device_empty(n, torch.uint8)
            for direction in ("h2d", "d2h"):
                pair = (dev, host) if direction == "h2d" else (host, dev)
                best = min(_time(transport, direction, pair) for _ in range(repeats))
                rows.append({"direction": direction, "pinned": pinned, "bytes": n, "gbps": n / best / 1e9})
            if pinned:
                transport.host_release(host)
            del dev, host
    return rows


def _time(transport, direction: str, pair) -> float:
    transport.synchronize()
    t0 = time.perf_counter()
    ev = getattr(transport, direction)([pair], label="bandwidth")
    ev.host_wait()
    return time.perf_counter() - t0


def best(rows: list[dict], direction: str, pinned: bool = True) -> float:
    """The bandwidth at the largest size measured for one direction."""
    sel = [r for r in rows if r["direction"] == direction and r["pinned"] == pinned]
    return max(sel, key=lambda r: r["bytes"])["gbps"] if sel else 0.0
