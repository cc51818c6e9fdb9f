"""Bytes on the link of a bf16 store computing in fp32, by `horizon profile` (issue 32).

    .venv/bin/python -m benchmarks.investigations.bench_widen [--gbps 0.005] [--modes lora,exact,lean] [--json FILE]

A 12-layer Llama-shaped store (hidden 256, intermediate 688, random bf16 weights) profiled with
`engine.dtype: float32` over an emulated link (`engine.link_gbps`), every layer recomputed
(`keep_activations: 0`), for each mode: a LoRA run (r 16 on every linear layer, the base frozen),
full fine-tuning `exact` and `lean`. Per mode: the bytes each direction carries in a step
(counted by the transport), one layer load's bytes, the busier direction's time, the step, and
the stored bytes of the step's weight loads (2 per layer and the head) with the time they need at
that link speed. Run it with another checkout's code (PYTHONPATH=/that/checkout) for a before /
after: a mode that checkout refuses is shown as refused.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml

from horizon_cli.errors import HorizonError
from horizon_cli.profile.run import run_profile
from tests.support.synthetic import random_store

MODEL = dict(
    model_type="llama",
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=12,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=8192,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def config(tmp: Path, store: Path, mode: str, gbps: float) -> Path:
    data = tmp / "d.jsonl"
    data.write_text(json.dumps({"input_ids": list(range(1, 33))}) + "\n")
    cfg = {
        "model": {"path": str(store)},
        "data": {"path": str(data), "format": "tokens", "max_seq_len": 256},
        "train": {"batch_size": 8, "micro_batch_size": 4},
        "optim": {"lr": 1e-5, "memory": "lean" if mode == "lean" else "exact"},
        "engine": {"device": "cpu", "dtype": "float32", "link_gbps": gbps, "keep_activations": 0},
        "output": {"dir": str(tmp / f"run-{mode}")},
    }
    if mode == "lora":
        cfg["lora"] = {"r": 16, "alpha": 32, "targets": "all-linear"}
    path = tmp / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gbps", type=float, default=0.005)
    ap.add_argument("--modes", default="lora,exact,lean")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-widen-") as d:
        tmp = Path(d)
        store = random_store(tmp / "store", MODEL, "bfloat16")
        layer = max(store.unit_bytes(u.name) for u in store.units if u.name.startswith("layer."))
        stored = 2 * MODEL["num_hidden_layers"] * layer + store.unit_bytes("head")
        for mode in args.modes.split(","):
            try:
                out = run_profile(config(tmp, tmp / "store", mode, args.gbps))
            except HorizonError as e:
                rows.append({"mode": mode, "refused": str(e)})
                print(f"{mode}: refused: {e}")
                continue
            row = {k: out[k] for k in ("h2d_bytes", "d2h_bytes", "layer_bytes", "transfer_s", "step_s")}
            row.update(mode=mode, stored_bytes=stored, stored_s=stored / (args.gbps * 1e9))
            rows.append(row)
    print(f"\nlink {args.gbps} GB/s; the step's weight loads hold {stored / 1e6:.1f} MB as stored")
    print("mode   h2d MB  d2h MB  layer MB  link s  stored s  step s")
    for r in rows:
        if "refused" in r:
            print(f"{r['mode']:<6} refused")
            continue
        print(
            f"{r['mode']:<6} {r['h2d_bytes'] / 1e6:6.1f}  {r['d2h_bytes'] / 1e6:6.1f}  "
            f"{r['layer_bytes'] / 1e6:8.2f}  {r['transfer_s']:6.1f}  {r['stored_s']:8.1f}  {r['step_s']:6.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
