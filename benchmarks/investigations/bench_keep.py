"""Kept layers (engine.keep_activations, issue 21): what keeping the top layers' graphs saves.

    .venv/bin/python -m benchmarks.investigations.bench_keep [--sizes 30m,120m] [--dtypes bfloat16,float32] [--rounds 5]
    .venv/bin/python -m benchmarks.investigations.bench_keep --paper [--device-gib 139]

CPU (default): one process builds the benchmark model (benchmarks/bench_peers.py's shapes, random weights,
batch 4 x 256, micro-batch 4, one compute thread per engine step) and two engines on the same store,
one recomputing every layer (K = 0), one keeping every layer (K = L); their steps alternate
(A B A B ...) after a warm-up step each, so load from other work on the machine falls on both alike.
Reported per engine: the median wall time of a step and the median CPU time of the thread that
computes (time.thread_time: the compute itself, not what other processes take from it; the AdamW
worker runs beside it on another thread). The arithmetic: a recomputed layer costs forward +
recompute + backward = 2 + 2 + 4 units, a kept one 2 + 4, so the layers' share of the step falls by
a quarter and the step (loss head and the rest unchanged) to about 0.8.

--paper: the plan's K on one H200 (--device-gib free, --host-gib of RAM) for Llama-3.1-8B and 70B at
batches 8 x 2048 and 64 x 2048 (micro-batch --micro), the bytes it keeps, and the compute it saves:
each kept layer's recompute forward (2 x its parameters + causal attention's forward, per token) of
the step's hardware FLOPs (benchmarks/gpu_throughput.py's count: 6 x parameters of the layers and
head, attention, plus every recomputed layer's forward). Nothing runs; the figures are the plan's.

Writes --json (default bench_out/keep.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SEQ, BATCH = 256, 4


def cpu_bench(args) -> list[dict]:
    import torch

    from benchmarks.common import SHAPES
    from horizon_cli.config.schema import EngineConfig, OptimConfig
    from horizon_cli.data.batch import MicroBatch
    from horizon_cli.engine import Engine
    from tests.support.synthetic import random_store

    torch.set_num_threads(args.threads)
    rows = []
    for size in args.sizes.split(","):
        sh = SHAPES[size]
        hf = {"model_type": "llama", "hidden_size": sh["hidden"], "intermediate_size": sh["intermediate"],
              "num_hidden_layers": sh["layers"], "num_attention_heads": sh["heads"], "vocab_size": sh["vocab"],
              "max_position_embeddings": 2048, "tie_word_embeddings": False}  # fmt: skip
        for dtype in args.dtypes.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                store = random_store(Path(tmp) / "store", hf, dtype)
                L = store.arch.n_layers
                ecfg = EngineConfig(device="cpu", dtype=dtype)
                engines = {
                    k: Engine(store, ecfg, OptimConfig(lr=1e-4), keep=k, max_tokens=BATCH * SEQ)
                    for k in (0, L)
                }
                g = torch.Generator().manual_seed(0)
                ids = torch.randint(0, store.arch.vocab, (BATCH, SEQ), generator=g)
                mbs = [MicroBatch(ids, ids.clone(), torch.arange(SEQ).expand(BATCH, SEQ))]
                wall: dict[int, list[float]] = {k: [] for k in engines}
                cpu: dict[int, list[float]] = {k: [] for k in engines}
                loads: dict[int, int] = {}
                try:
                    for r in range(args.rounds + 1):
                        for k, eng in engines.items():
                            eng.wait()  # the previous update landed: each step starts alike
                            w0, c0 = time.perf_counter(), time.thread_time()
                            res = eng.step(mbs, 1e-4)
                            eng.wait()
                            if r:  # the first round warms up (oneDNN compiles per shape)
                                wall[k].append(time.perf_counter() - w0)
                                cpu[k].append(time.thread_time() - c0)
                            loads[k] = res.weight_loads
                finally:
                    for eng in engines.values():
                        eng.close()
            med = {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in engines}
            row = {"size": size, "dtype": dtype, "layers": L, "rounds": args.rounds,
                   "recompute_step_s": med[0][0], "keep_step_s": med[L][0],
                   "recompute_cpu_s": med[0][1], "keep_cpu_s": med[L][1],
                   "wall_ratio": med[L][0] / med[0][0], "cpu_ratio": med[L][1] / med[0][1],
                   "weight_loads": {"recompute": loads[0], "keep": loads[L]}}  # fmt: skip
            rows.append(row)
            print(
                f"{size} {dtype}: step {med[0][0] * 1e3:.0f} -> {med[L][0] * 1e3:.0f} ms (x{row['wall_ratio']:.3f}), "
                f"compute thread {med[0][1] * 1e3:.0f} -> {med[L][1] * 1e3:.0f} ms (x{row['cpu_ratio']:.3f}), "
                f"loads {loads[0]} -> {loads[L]}",
                flush=True,
            )
    return rows


LLAMA = {
    "Llama-3.1-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "Llama-3.1-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}  # fmt: skip


def paper(args) -> list[dict]:
    from benchmarks.gpu_throughput import flops_per_token
    from horizon_cli.arch import spec_from_hf
    from horizon_cli.config import load_config
    from horizon_cli.planning.fit import Machine
    from horizon_cli.planning.ladder import plan_for
    from horizon_cli.store import layouts

    where = Machine(int(args.host_gib * 2**30), int(args.device_gib * 2**30), "one H200")
    rows = []
    for name, dims in LLAMA.items():
        spec = spec_from_hf(dict(model_type="llama", num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                                 max_position_embeddings=131072, **dims))  # fmt: skip
        layer = max(x.params for x in layouts(spec) if x.name.startswith("layer."))
        for batch in (8, 64):
            base = {"model": {"path": "m"}, "data": {"path": "d", "max_seq_len": 2048}, "output": {"dir": "o"},
                    "train": {"batch_size": batch, "micro_batch_size": args.micro}}  # fmt: skip
            cfg = load_config(None, base=base)
            p = plan_for(cfg, spec, "exact", where=where)
            L, K = spec.n_layers, p.kept
            _, hw = flops_per_token(spec, 2048)  # with every layer's recompute forward
            attn_fwd = 2 * 2 * spec.q_dim * 2048 / 2  # one layer's causal QK^T and AV, per token
            saved = K * (2 * layer + attn_fwd)
            row = {"model": name, "batch": f"{batch} x 2048", "micro": args.micro, "layers": L, "kept": K,
                   "kept_gib": p.kept_bytes / 2**30, "per_layer_gib": sum(p.kept_layer) / 2**30,
                   "device_gib": p.device_total / 2**30, "host_gib": p.host_total / 2**30,
                   "compute_saved": saved / hw, "loads": f"{2 * L} -> {2 * L - K}"}  # fmt: skip
            rows.append(row)
            print(
                f"{name} {row['batch']}: K = {K} of {L} ({row['kept_gib']:.1f} GiB, {row['per_layer_gib']:.2f} per "
                f"layer), device {row['device_gib']:.1f} GiB, compute saved {row['compute_saved']:.1%}, loads {row['loads']}",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="30m,120m")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=5, help="measured steps per engine (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--paper", action="store_true", help="the plan's K and compute saved on one H200")
    ap.add_argument("--device-gib", type=float, default=139.0, help="--paper: free device memory, GiB")
    ap.add_argument("--host-gib", type=float, default=2048.0, help="--paper: host RAM, GiB")
    ap.add_argument("--micro", type=int, default=1, help="--paper: micro-batch size")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "keep.json")
    args = ap.parse_args()
    rows = paper(args) if args.paper else cpu_bench(args)
    out = {
        "command": " ".join(
            [".venv/bin/python", "-m", "benchmarks.investigations.bench_keep", *sys.argv[1:]]
        ),
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
