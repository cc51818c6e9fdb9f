"""NF4 quantize / dequantize speed on the CPU: the bitsandbytes layout (what convert writes and the
engine dequantizes) against horizon's older layout (dequantize only: it is no longer written).

    .venv/bin/python -m benchmarks.investigations.bench_nf4 [--rows 3584 --cols 2048 --threads 1 --repeat 5]

Times the best of --repeat runs on one (rows, cols) bf16 weight of torch.randn * 0.02. Results:
docs/benchmarks.md ("NF4").
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from horizon_cli.quant import nf4


def best(f, k: int) -> float:
    out = []
    for _ in range(k):
        t = time.perf_counter()
        f()
        out.append(time.perf_counter() - t)
    return min(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=3584)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    n = a.rows * a.cols
    w = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    buf = torch.zeros(nf4.nbytes(n, 2, "bnb"), dtype=torch.uint8)
    nf4.pack(nf4.quantize(w), buf)
    old = torch.zeros(nf4.nbytes(n, 2, "torchao"), dtype=torch.uint8)  # the arithmetic, not the values
    out = torch.empty(n, dtype=torch.bfloat16)
    res = {
        "elements": n,
        "threads": a.threads,
        "quantize_s": best(lambda: nf4.quantize(w), a.repeat),
        "dequantize_s": best(lambda: nf4.dequantize_packed(buf, n, torch.bfloat16, out, "bnb"), a.repeat),
        "dequantize_older_layout_s": best(
            lambda: nf4.dequantize_packed(old, n, torch.bfloat16, out, "torchao"), a.repeat
        ),
    }
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
