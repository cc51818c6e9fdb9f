"""Sequence tiles (engine.seq_tile, issue 30): what tiling a layer's MLP saves, what it costs, and
how long a sequence the plan trains on one H200.

    .venv/bin/python -m benchmarks.investigations.bench_tile --peak [--seqs 4096,8192,16384,32768,65536] [--tile 1024]
    .venv/bin/python -m benchmarks.investigations.bench_tile --time [--seq 4096] [--rounds 5]
    .venv/bin/python -m benchmarks.investigations.bench_tile --paper [--device-gib 141 --host-gib 1536]
    .venv/bin/python -m benchmarks.investigations.bench_tile --generic mistral,qwen3_moe,qwen3_next --peak|--time ...

--generic FAMILY[,...]: --peak and --time on transformers' own layers instead of the native one
(benchmarks/investigations/bench_tile_generic.py says what is built and measured).

--peak: one native layer's forward + backward on the CPU (fp32, one thread), untiled and tiled
(natively every token-local part, attention per query tile: model.tiled_layer), at each length: the measured peak resident memory and the plan's layer working set
(tests.support.layer_peak, one process per length). The layer is narrow with a wide MLP
(hidden 128, 2 heads of 64, one K/V head, intermediate 2048) so that 64K tokens of attention stay
within minutes on one core; the measured peak includes the weight gradients (3.2 MiB).

--time: the step-time cost of tiling at a moderate length: two engines on the same store
(benchmarks/common.py's 30m shape: hidden 512, 8 layers, intermediate 1376), one untiled, one
with tiles of --tile tokens, one row of --seq tokens a step, steps alternating A B A B after a
warm-up step each; the median wall time and the median CPU time of the computing thread.

--paper: the plan's longest trainable sequence per rung (engine.seq_tile: auto, batch 1, no layer
kept) for Llama-3.1-8B and -70B, Qwen3-30B-A3B and Mistral-Large-2407 (their released config.json;
the positions raised to 16M so the memory alone bounds it), and the two goals' plans: Llama-3.1-8B
at 1,048,576 tokens and Llama-3.1-70B at 524,288, rung by rung. Nothing runs; the figures are the
plan's.

Writes --json (default bench_out/tile.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
LLAMA_31 = dict(
    model_type="llama", num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
    rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)  # fmt: skip
LLAMA = {
    "Llama-3.1-8B": dict(LLAMA_31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "Llama-3.1-70B": dict(LLAMA_31, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}  # fmt: skip
GIB = 2**30


def peak(args) -> list[dict]:
    rows = []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for seq in map(int, args.seqs.split(",")):
        job = dict(hidden=128, intermediate=2048, tokens=seq, tiles=[0, args.tile], warm_tokens=2048)
        out = subprocess.run([sys.executable, "-m", "tests.support.layer_peak", json.dumps(job)],
                             capture_output=True, text=True, env=env, check=True)  # fmt: skip
        got = json.loads(out.stdout.strip().splitlines()[-1])
        for r in got["runs"]:
            row = {"tokens": seq, **r, "weight_grad_bytes": got["weight_grad_bytes"]}
            rows.append(row)
            what = f"tiles of {r['tile']}" if r["tile"] else "untiled"
            print(
                f"{seq:>6} tokens, {what:>15}: measured "
                f"{r['peak_bytes'] / 2**20:8.1f} MiB, plan {r['plan_bytes'] / 2**20:8.1f} MiB, {r['seconds']:.1f} s",
                flush=True,
            )
    return rows


def step_time(args) -> list[dict]:
    import torch

    from benchmarks.common import SHAPES
    from horizon_cli.config.schema import EngineConfig, OptimConfig
    from horizon_cli.data.batch import MicroBatch
    from horizon_cli.engine import Engine
    from tests.support.synthetic import random_store

    torch.set_num_threads(1)
    sh = SHAPES["30m"]
    hf = {"model_type": "llama", "hidden_size": sh["hidden"], "intermediate_size": sh["intermediate"],
          "num_hidden_layers": sh["layers"], "num_attention_heads": sh["heads"], "vocab_size": sh["vocab"],
          "max_position_embeddings": args.seq, "tie_word_embeddings": False}  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, sh["vocab"], (1, args.seq), generator=g)
    mb = MicroBatch(ids, ids.clone(), torch.arange(args.seq)[None].clone())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = random_store(Path(tmp) / "store", hf, "float32")
        engines = {
            t: Engine(
                store, EngineConfig(device="cpu", dtype="float32", seq_tile=t), OptimConfig(kernel="torch")
            )
            for t in (0, args.tile)
        }
        wall: dict[int, list[float]] = {t: [] for t in engines}
        cpu: dict[int, list[float]] = {t: [] for t in engines}
        try:
            for r in range(args.rounds + 1):
                for t, eng in engines.items():
                    c0, w0 = thread_cpu(), time.perf_counter()
                    eng.step([mb], 1e-5)
                    eng.wait()
                    if r:  # the first step of each is a warm-up
                        wall[t].append(time.perf_counter() - w0)
                        cpu[t].append(thread_cpu() - c0)
        finally:
            for eng in engines.values():
                eng.close()
    for t in engines:
        row = {
            "tile": t,
            "tokens": args.seq,
            "wall_s": statistics.median(wall[t]),
            "cpu_s": statistics.median(cpu[t]),
        }
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["wall_vs_untiled"] = row["wall_s"] / base["wall_s"]
        row["cpu_vs_untiled"] = row["cpu_s"] / base["cpu_s"]
        print(f"tile {row['tile']}: step {row['wall_s']:.2f} s wall ({row['wall_vs_untiled']:.3f}), "
              f"{row['cpu_s']:.2f} s compute thread ({row['cpu_vs_untiled']:.3f})", flush=True)  # fmt: skip
    return rows


def thread_cpu() -> float:
    return (
        time.thread_time() if threading.current_thread() is threading.main_thread() else time.process_time()
    )


def paper(args) -> list[dict]:
    from horizon_cli.arch import spec_from_hf
    from horizon_cli.config import load_config
    from horizon_cli.parallel.topology import World
    from horizon_cli.planning.fit import Machine
    from horizon_cli.planning.ladder import longest_seq, plan_for
    from horizon_cli.planning.memory import RUNGS
    from horizon_cli.planning.tiling import slack

    where = Machine(int(args.host_gib * GIB), int(args.device_gib * GIB), "one H200")
    models = dict(LLAMA)
    for name, file in (("Qwen3-30B-A3B", "qwen3-30b-a3b"), ("Mistral-Large-2407", "mistral-large-2407")):
        models[name] = json.loads((FIXTURES / f"{file}.config.json").read_text())
    rows = []

    def cfg(seq: int):
        base = {"model": {"path": "m"}, "data": {"path": "d", "max_seq_len": seq}, "output": {"dir": "o"},
                "train": {"batch_size": 1, "micro_batch_size": 1}, "engine": {"dtype": "bfloat16", "keep_activations": 0}}  # fmt: skip
        return load_config(None, base=base)

    for name, hf in models.items():
        spec = spec_from_hf({**hf, "max_position_embeddings": 1 << 24})
        reach = {r: longest_seq(cfg(4096), spec, r, None, World(), where, 1 << 24) for r in RUNGS}
        rows.append({"model": name, "longest": reach})
        print(f"{name}: " + ", ".join(f"{r} {n:,}" for r, n in reach.items()), flush=True)
    for name, seq in (("Llama-3.1-8B", 1 << 20), ("Llama-3.1-70B", 1 << 19)):
        spec = spec_from_hf({**LLAMA[name], "max_position_embeddings": seq})
        for r in RUNGS:
            p = plan_for(cfg(seq), spec, r, where=where)
            row = {"goal": f"{name} at {seq:,}", "rung": r, "fits": slack(p, where) >= 0, "seq_tile": p.seq_tile,
                   "device_gib": p.device_total / GIB, "host_gib": p.host_total / GIB,
                   "layer_work_gib": p.device["layer working set"] / GIB, "untiled_work_gib": p.untiled_work / GIB}  # fmt: skip
            rows.append(row)
            print(f"{row['goal']} {r}: {'fits' if row['fits'] else 'no'}, tile {p.seq_tile:,}, device "
                  f"{row['device_gib']:.2f} GiB (working set {row['layer_work_gib']:.2f}, untiled "
                  f"{row['untiled_work_gib']:.2f}), host {row['host_gib']:.1f} GiB", flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peak", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--paper", action="store_true")
    ap.add_argument(
        "--generic", default="", help="FAMILY[,FAMILY]: transformers' layers (bench_tile_generic)"
    )
    ap.add_argument("--seqs", default="4096,8192,16384,32768,65536")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--tile", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device-gib", type=float, default=141.0)
    ap.add_argument("--host-gib", type=float, default=1536.0)
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "tile.json")
    args = ap.parse_args()
    out: dict = {
        "command": " ".join([".venv/bin/python", "-m", "benchmarks.investigations.bench_tile", *sys.argv[1:]])
    }
    out["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    if args.generic:
        from benchmarks.investigations import bench_tile_generic as bg

        fams = args.generic.split(",")
        if args.peak:
            out["generic_peak"] = bg.peak(fams, [int(s) for s in args.seqs.split(",")], args.tile)
        if args.time:
            out["generic_time"] = bg.step_time(fams, args.seq, args.tile, args.rounds)
    elif args.peak:
        out["peak"] = peak(args)
    if args.time and not args.generic:
        out["time"] = step_time(args)
    if args.paper:
        out["paper"] = paper(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    out["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    args.json.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
