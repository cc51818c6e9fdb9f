"""Where horizon's step time goes on the CPU, phase by phase (issue E.3).

    .venv/bin/python -m benchmarks.investigations.profile_phases [--size 30m|120m] [--dtype bfloat16|float32] [--json F]

Runs the benchmark model (benchmarks/bench_peers.py's shapes, batch 4 x seq 256, micro-batch 4) for one
warm-up and four measured steps with the timeline on, and splits the median step into:

  forward            device compute of the forward layers
  recompute          the backward's re-run of each layer's forward (taken as the forward's time)
  backward           the rest of each layer's backward
  loss head          norm + LM head + chunked cross-entropy, forward and backward
  host work          embedding gather, embedding grad scatter-add, the global norm (one sync)
  exposed other      what is left of the step: Python between layers, waits on copies or on the
                     optimizer of the previous step (copies and AdamW run beside the compute)
  (beside) copies    busy time of the copy threads, overlapped
  (beside) AdamW     busy time of the optimizer worker, overlapped with the next step
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.data.batch import MicroBatch
from horizon_cli.engine import Engine
from horizon_cli.profile.timeline import busy
from horizon_cli.runtime.trace import Tracer
from tests.support.synthetic import random_store

SIZES = {
    "30m": dict(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, vocab_size=8192
    ),
    "120m": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        vocab_size=32000,
    ),
}


def phases(spans, steps) -> dict[str, float]:
    out = {}
    for a, b in steps:
        win = [s for s in spans if a <= s.t0 < b]
        comp = [s for s in win if s.lane == "compute"]
        fwd = sum(s.t1 - s.t0 for s in comp if s.name.startswith("fwd"))
        bwd = sum(s.t1 - s.t0 for s in comp if s.name.startswith("bwd"))
        row = {
            "step": b - a,
            "forward": fwd,
            "recompute": fwd,
            "backward": bwd - fwd,
            "loss head": sum(s.t1 - s.t0 for s in comp if s.name == "head"),
            "host work": sum(s.t1 - s.t0 for s in win if s.lane == "host"),
            "(beside) copies": busy([s for s in win if s.lane in ("h2d", "d2h")]),
            "(beside) AdamW": busy([s for s in win if s.lane == "optimizer"]),
        }
        main = busy([s for s in win if s.lane in ("compute", "host")])
        row["exposed other"] = row["step"] - main
        for k, v in row.items():
            out.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="30m", choices=SIZES)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {
            "model_type": "llama",
            "max_position_embeddings": 2048,
            "tie_word_embeddings": False,
            **SIZES[args.size],
        }
        store = random_store(Path(tmp) / "store", cfg, args.dtype)
        tracer = Tracer(enabled=True)
        eng = Engine(store, EngineConfig(device="cpu", dtype=args.dtype), OptimConfig(lr=1e-4), tracer=tracer)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, store.arch.vocab, (4, 256), generator=g)
        mbs = [MicroBatch(ids, ids.clone(), torch.arange(256).expand(4, 256))]
        for _ in range(args.steps + 1):
            eng.step(mbs, 1e-4)
        eng.close()
    steps = sorted((s for s in tracer.spans if s.lane == "step"), key=lambda s: s.t0)
    windows = [(steps[i].t0, steps[i + 1].t0) for i in range(1, len(steps) - 1)]
    res = phases(tracer.spans, windows)
    print(f"{args.size} {args.dtype}, batch 4 x 256, median of {len(windows)} steps")
    for k, v in res.items():
        share = f"{100 * v / res['step']:5.1f}%" if k != "step" else ""
        print(f"  {k:16s} {1e3 * v:9.1f} ms  {share}")
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "dtype": args.dtype, **res}, indent=1))


if __name__ == "__main__":
    main()
