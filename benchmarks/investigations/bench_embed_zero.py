"""The untied embedding gradient's zero at each backward: the whole (V, H) fp32 buffer against
only the rows the previous backward wrote (engine/embed.py, HostEmbedding._zero; issue 42). Superseded: the
gradient now holds only the rows a step touched (state/host.py UnitState.rows), zeroed and normed alone.

    python3 benchmarks/investigations/bench_embed_zero.py [--vocab 128256] [--hidden 4096] [--tokens 8192]

Best of 5 each; the rows are the unique ids of `tokens` uniform random tokens.
"""

from __future__ import annotations

import argparse
import time

import torch


def best(fn, n: int = 5) -> float:
    out = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    g = torch.zeros(args.vocab, args.hidden)
    rows = torch.randint(0, args.vocab, (args.tokens,), generator=torch.Generator().manual_seed(0)).unique()
    whole = best(g.zero_)
    touched = best(lambda: g.index_fill_(0, rows, 0.0))
    print(f"V {args.vocab} x H {args.hidden} fp32 ({g.numel() * 4 / 2**30:.2f} GiB), {len(rows)} rows touched: "
          f"whole {whole * 1e3:.1f} ms, touched rows {touched * 1e3:.2f} ms, {torch.get_num_threads()} threads")  # fmt: skip


if __name__ == "__main__":
    main()
