"""Host <-> device bandwidth on CUDA from three kinds of host memory, for docs/engine.md's choice:

registered  ordinary memory page-locked in place with cudaHostRegister (what horizon uses)
pinned      torch's pinned allocator (cudaHostAlloc; rounds blocks up to a power of two)
staging     pageable memory copied through a small pinned staging buffer by the CPU first
pageable    plain pageable memory handed to cudaMemcpy

  python3 benchmarks/gpu_pinned.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SIZES = [16 << 20, 256 << 20, 1 << 30]


def timed(fn, repeats=5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def measure_size(n: int) -> list[dict]:
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    reg = torch.empty(n, dtype=torch.uint8)
    assert int(torch.cuda.cudart().cudaHostRegister(reg.data_ptr(), n, 0)) == 0
    pin = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    page = torch.empty(n, dtype=torch.uint8)
    stage = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)

    def staged_h2d():
        for a in range(0, n, stage.numel()):
            b = min(n, a + stage.numel())
            stage[: b - a].copy_(page[a:b])
            dev[a:b].copy_(stage[: b - a], non_blocking=True)
            torch.cuda.current_stream().synchronize()  # the staging buffer is reused

    kinds = {
        "registered": (lambda: dev.copy_(reg, non_blocking=True), lambda: reg.copy_(dev, non_blocking=True)),
        "pinned": (lambda: dev.copy_(pin, non_blocking=True), lambda: pin.copy_(dev, non_blocking=True)),
        "pageable": (lambda: dev.copy_(page), lambda: page.copy_(dev)),
        "staging": (staged_h2d, None),
    }
    rows = []
    for kind, (h2d, d2h) in kinds.items():
        row = {"bytes": n, "kind": kind, "h2d_gbps": n / timed(h2d) / 1e9}
        if d2h is not None:
            row["d2h_gbps"] = n / timed(d2h) / 1e9
        rows.append(row)
        print(row, flush=True)
    torch.cuda.cudart().cudaHostUnregister(reg.data_ptr())
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = [row for n in SIZES for row in measure_size(n)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
