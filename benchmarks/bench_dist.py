"""Sharded data parallelism on this CPU: 2 ranks x 1 thread against 1 rank x 2 threads.

    .venv/bin/python benchmarks/bench_dist.py --size 30m --repeat 2 --json bench_out/dist.json

One random Llama-shaped checkpoint (benchmarks/common.py SHAPES), converted to a store, and the
same token rows (`tokens` format) at the same global batch, trained by `horizon train` in a child
process (1 rank, engine.compute_threads 2) and by `torchrun --nproc-per-node 2 -m horizon_cli
train` (gloo, engine.compute_threads 1 per rank). Reported per mode: tokens/s after the first step
(the global batch's tokens over the step time rank 0 measures), the engine's host state per rank
(its start-up line), the largest single process's peak RSS (ru_maxrss over the process tree: one
rank) and the whole tree's sampled peak. Repeats are interleaved; the best tokens/s and the lowest
RSS are kept, and the share of the CPU other processes used meanwhile is recorded.

Both modes use the machine's two cores: this measures what sharding costs (the collectives, the
embedding on the "device", smaller matmuls per rank) and what it saves (host state per rank), not
a speed-up, which needs one device per rank.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

import horizon_runs
from common import SHAPES, param_count
from runner import ROOT, GiB

MODES = {"1x2": (1, 2), "2x1": (2, 1)}  # ranks x threads per rank
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="30m", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--work", type=Path, default=ROOT / "bench_out" / "dist")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "dist.json")
    return ap.parse_args(argv)


def host_state(log: Path) -> int:
    """The engine's host state (per rank) from its start-up line."""
    text = " ".join(log.read_text().split())
    m = re.search(r"host state ([\d.]+) (B|KiB|MiB|GiB)", text)
    return int(float(m.group(1)) * UNITS[m.group(2)]) if m else 0


def train(a: argparse.Namespace, mode: str, paths: dict, tag: str) -> dict:
    ranks, threads = MODES[mode]
    run = a.work / a.size / "runs" / f"{mode}-{tag}"
    shutil.rmtree(run, ignore_errors=True)
    engine = {"dtype": a.dtype, "compute_threads": threads}
    cfg = horizon_runs.write_config(run, paths["store"], paths["data"], a, a.steps, engine)
    cmd = horizon_runs.horizon_cmd()
    if ranks > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            *cmd[1:],
        ]
    child, rows, log = horizon_runs.train([*cmd, str(cfg)], run, threads, limit_gib=16)
    return {
        "tokens_per_s": horizon_runs.tokens_per_s(rows),
        "host_state_per_rank": host_state(log),
        "peak_rss_per_process": child.peak_rss,
        "peak_rss_tree": child.sampled_peak,
        "others_cpu": child.others,
        "losses": [r["loss"] for r in rows],
    }


def main(argv=None) -> None:
    a = parse_args(argv)
    paths = horizon_runs.prepare(a.work / a.size, a.size, a.seq, a.batch * (a.steps + 2), {"store": ""})
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for k in range(a.repeat):
        for m in MODES:
            r = train(a, m, paths, f"r{k}")
            runs[m].append(r)
            print(f"{m}: repeat {k}: {r['tokens_per_s']:8.1f} tok/s, host state/rank "
                  f"{r['host_state_per_rank'] / GiB:.3f} GiB, peak RSS/process {r['peak_rss_per_process'] / GiB:.2f} GiB, "
                  f"others {r['others_cpu']:.0%}", flush=True)  # fmt: skip
    out = {"size": a.size, "params": param_count(SHAPES[a.size]), "batch": a.batch, "seq": a.seq, "modes": {}}
    for m in MODES:
        top = max(runs[m], key=lambda r: r["tokens_per_s"])
        out["modes"][m] = {
            **horizon_runs.best(runs[m]),
            "host_state_per_rank": top["host_state_per_rank"],
            "peak_rss_per_process_gib": min(r["peak_rss_per_process"] for r in runs[m]) / GiB,
            "peak_rss_tree_gib": min(r["peak_rss_tree"] for r in runs[m]) / GiB,
        }
    horizon_runs.save(out, a.json)


if __name__ == "__main__":
    main()
