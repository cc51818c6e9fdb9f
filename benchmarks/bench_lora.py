"""LoRA against full fine-tuning on this machine: tokens/s, peak RSS, and the bytes on the link.

    .venv/bin/python benchmarks/bench_lora.py --size 120m --repeat 2 --json bench_out/lora.json

One random Llama-shaped checkpoint (benchmarks/common.py SHAPES, bf16), converted twice: a bf16
store and an NF4 store (`--quantize nf4`). Three modes, each `horizon train` in a child process
(benchmarks/runner.py: ru_maxrss is the peak RSS) on the same token rows (`tokens` format):

  full    full fine-tuning of the bf16 store
  lora    LoRA r 16, alpha 32, every linear layer (all-linear), on the bf16 store
  qlora   the same on the NF4 store

`engine.device: cpu` as the tests run it: without an emulated link the loader lends host memory,
nothing crosses a link, and tokens/s is the compute. A second, short run per mode with
`engine.link_gbps` set (copies on the link threads, unthrottled) counts the bytes each step moves
host -> device and device -> host (the metrics' h2d_bytes / d2h_bytes). Repeats are interleaved
(full, lora, qlora, full, ...); the best tokens/s and the lowest peak RSS of the repeats are kept,
and the share of the CPU other processes used meanwhile is recorded (the machine is shared).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import horizon_runs
from common import SHAPES, param_count
from runner import ROOT, GiB

MODES = ("full", "lora", "qlora")
LORA = {"r": 16, "alpha": 32, "targets": "all-linear"}
STORES = {"store-bf16": "", "store-nf4": "nf4"}  # directory -> convert --quantize


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="120m", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--work", type=Path, default=ROOT / "bench_out" / "lora")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "lora.json")
    return ap.parse_args(argv)


def train(a: argparse.Namespace, mode: str, paths: dict, tag: str, link: float = 0.0, steps: int = 0) -> dict:
    run = a.work / a.size / "runs" / f"{mode}-{tag}"
    shutil.rmtree(run, ignore_errors=True)
    store = paths["store-nf4" if mode == "qlora" else "store-bf16"]
    engine = {"dtype": "bfloat16", "compute_threads": a.threads, "link_gbps": link}
    lora = {"lora": dict(LORA)} if mode != "full" else {}
    cfg = horizon_runs.write_config(run, store, paths["data"], a, steps or a.steps, engine, **lora)
    child, rows, _ = horizon_runs.train([*horizon_runs.horizon_cmd(), str(cfg)], run, a.threads, limit_gib=20)
    return {
        "tokens_per_s": horizon_runs.tokens_per_s(rows),
        "peak_rss": child.peak_rss,
        "others_cpu": child.others,
        "losses": [r["loss"] for r in rows],
        "h2d_bytes": rows[-1]["h2d_bytes"],
        "d2h_bytes": rows[-1]["d2h_bytes"],
        "weight_loads": rows[-1]["weight_loads"],
    }


def main(argv=None) -> None:
    a = parse_args(argv)
    modes = a.modes.split(",")
    paths = horizon_runs.prepare(a.work / a.size, a.size, a.seq, a.batch * (a.steps + 2), STORES)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for k in range(a.repeat):
        for m in modes:
            r = train(a, m, paths, f"r{k}")
            runs[m].append(r)
            print(f"{m:6s} repeat {k}: {r['tokens_per_s']:8.1f} tok/s, peak RSS {r['peak_rss'] / GiB:.2f} GiB, "
                  f"others {r['others_cpu']:.0%}", flush=True)  # fmt: skip
    link = {m: train(a, m, paths, "link", link=1000.0, steps=2) for m in modes}
    from horizon_cli.store import Store

    # one layer's load, bf16 and NF4
    layer = {k: Store.open(paths[f"store-{k}"]).unit_bytes("layer.0") for k in ("bf16", "nf4")}
    out = {"size": a.size, "params": param_count(SHAPES[a.size]), "batch": a.batch, "seq": a.seq, "modes": {}}
    out["layer_bytes"] = layer
    for m in modes:
        out["modes"][m] = {
            **horizon_runs.best(runs[m]),
            "peak_rss_gib": min(r["peak_rss"] for r in runs[m]) / GiB,
            "h2d_bytes_per_step": link[m]["h2d_bytes"],
            "d2h_bytes_per_step": link[m]["d2h_bytes"],
            "weight_loads": link[m]["weight_loads"],
        }
    horizon_runs.save(out, a.json)


if __name__ == "__main__":
    main()
