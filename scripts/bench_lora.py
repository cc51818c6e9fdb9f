"""LoRA against full fine-tuning on this machine: tokens/s, peak RSS, and the bytes on the link.

    .venv/bin/python scripts/bench_lora.py --size 120m --repeat 2 --json bench_out/lora.json

One random Llama-shaped checkpoint (scripts/peers/common.py SHAPES, bf16), converted twice: a bf16
store and an NF4 store (`--quantize nf4`). Three modes, each `horizon train` in a child process
(scripts/peers/runner.py: ru_maxrss is the peak RSS) on the same token rows (`tokens` format):

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
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
import yaml  # noqa: E402
from common import SHAPES, make_rows, param_count, write_rows  # noqa: E402
from runner import ROOT, GiB, child_env, run_child  # noqa: E402

MODES = ("full", "lora", "qlora")
LORA = {"r": 16, "alpha": 32, "targets": "all-linear"}


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


def prepare(a: argparse.Namespace) -> dict[str, Path]:
    """The checkpoint, its two stores and the token rows (made once, reused by later runs)."""
    work = a.work / a.size
    stores = {"bf16": work / "store-bf16", "nf4": work / "store-nf4"}
    data = work / "rows.jsonl"
    if not all((s / "manifest.json").is_file() for s in stores.values()) or not data.is_file():
        from prepare import save_stream

        from horizon_cli.convert import convert

        hf = work / "hf"
        save_stream({"shape": SHAPES[a.size], "seq": a.seq, "hf_dtype": "bfloat16", "seed": 0}, hf)
        convert(hf, stores["bf16"], dtype="bfloat16", force=True)
        convert(hf, stores["nf4"], dtype="bfloat16", force=True, quantize="nf4")
        shutil.rmtree(hf)
        rows = make_rows(a.batch * (a.steps + 2), a.seq, SHAPES[a.size]["vocab"])
        write_rows(rows, data)
    return {**stores, "data": data}


def config(a: argparse.Namespace, mode: str, paths: dict, run: Path, link: float, steps: int) -> Path:
    cfg = {
        "model": {"path": str(paths["nf4" if mode == "qlora" else "bf16"])},
        "data": {"path": str(paths["data"]), "format": "tokens", "max_seq_len": a.seq, "shuffle": False},
        "train": {"steps": steps, "batch_size": a.batch, "micro_batch_size": a.micro},
        "optim": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.0, "grad_clip": 1.0},
        "schedule": {"kind": "constant"},
        "engine": {"device": "cpu", "dtype": "bfloat16", "compute_threads": a.threads, "link_gbps": link},
        "output": {"dir": str(run), "export": False},
        "log": {"every": 1, "plot": False},
    }
    if mode != "full":
        cfg["lora"] = dict(LORA)
    path = run.parent / f"{run.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# .venv/bin/horizon train {path}\n" + yaml.safe_dump(cfg, sort_keys=False))
    return path


def train(a: argparse.Namespace, mode: str, paths: dict, tag: str, link: float = 0.0, steps: int = 0) -> dict:
    run = a.work / a.size / "runs" / f"{mode}-{tag}"
    shutil.rmtree(run, ignore_errors=True)
    cfg = config(a, mode, paths, run, link, steps or a.steps)
    cmd = [sys.executable, "-m", "horizon_cli.cli", "train", str(cfg)]
    child = run_child(cmd, run.parent / f"{mode}-{tag}.log", child_env(a.threads), limit_bytes=20 * GiB)
    if child.rc != 0:
        raise SystemExit(f"{mode}: exit {child.rc} {child.killed} (see {run.parent / f'{mode}-{tag}.log'})")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    shutil.rmtree(run, ignore_errors=True)
    timed = rows[1:]  # the first step compiles kernels for new shapes
    return {
        "tokens_per_s": sum(r["input_tokens"] for r in timed) / sum(r["step_s"] for r in timed),
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
    paths = prepare(a)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for k in range(a.repeat):
        for m in modes:
            r = train(a, m, paths, f"r{k}")
            runs[m].append(r)
            print(f"{m:6s} repeat {k}: {r['tokens_per_s']:8.1f} tok/s, peak RSS {r['peak_rss'] / GiB:.2f} GiB, "
                  f"others {r['others_cpu']:.0%}", flush=True)  # fmt: skip
    link = {m: train(a, m, paths, "link", link=1000.0, steps=2) for m in modes}
    from horizon_cli.store import Store

    layer = {k: Store.open(paths[k]).unit_bytes("layer.0") for k in ("bf16", "nf4")}  # one layer's load
    out = {"size": a.size, "params": param_count(SHAPES[a.size]), "batch": a.batch, "seq": a.seq, "modes": {}}
    out["layer_bytes"] = layer
    for m in modes:
        best = max(runs[m], key=lambda r: r["tokens_per_s"])
        out["modes"][m] = {
            "tokens_per_s": best["tokens_per_s"],
            "peak_rss_gib": min(r["peak_rss"] for r in runs[m]) / GiB,
            "others_cpu": [r["others_cpu"] for r in runs[m]],
            "all_tokens_per_s": [r["tokens_per_s"] for r in runs[m]],
            "h2d_bytes_per_step": link[m]["h2d_bytes"],
            "d2h_bytes_per_step": link[m]["d2h_bytes"],
            "weight_loads": link[m]["weight_loads"],
            "losses": best["losses"],
        }
    print(json.dumps(out["modes"], indent=1))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
