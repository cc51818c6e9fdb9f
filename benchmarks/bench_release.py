"""Gradient release (optim.grad_release, issue 39) on the CPU: peak RSS and step time with and without.

    .venv/bin/python benchmarks/bench_release.py                   # ~162M Llama shape, fp32 exact
    .venv/bin/python benchmarks/bench_release.py --layers 4 --steps 3 --repeats 1   # quick

Builds a random Llama-shaped fp32 store once (benchmarks/prepare.py, `bench_out/release/`), then
runs each case in a fresh child process (Engine.step, `device: cpu`, no checkpoint): its peak RSS
(ru_maxrss) and its median step time after the first step. Cases: release off / on at
grad_clip 0 (one pass), and off / on at grad_clip 1 (release: the norm-first pass), interleaved
`--repeats` times (the machine is shared: the median of the repeats is reported, every sample kept
in `--json`). The plan's host gradient bytes come from `horizon train --dry-run --json` on the same
store and shape, release off and on (its `host` category "gradients ..."): every unit's fp32
gradient without release (4 B/param), RELEASE_BUFFERS buffers the size of the largest unit's (the
head's) plus the embedding's fp32 gradient with it (optim/modes.py grad_bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = ROOT / "bench_out" / "release"
CASES = [("off", 0.0), ("on", 0.0), ("off", 1.0), ("on", 1.0)]


def prepare(shape: dict, seq: int) -> Path:
    store = OUT / f"store-{shape['layers']}"
    if (store.parent / (store.name + ".ok")).is_file():
        return store
    OUT.mkdir(parents=True, exist_ok=True)
    job = {"shape": shape, "seq": seq, "hf_dir": str(OUT / "hf"), "store": str(store), "drop_hf": True}
    (OUT / "job.json").write_text(json.dumps(job))
    subprocess.run([sys.executable, str(HERE / "prepare.py"), str(OUT / "job.json")], check=True)
    return store


def plan(store: Path, release: str, clip: float, batch: int, seq: int) -> dict:
    """`horizon train --dry-run --json` for this case: its host plan (bytes by category)."""
    rows = OUT / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [1] * seq}) + "\n" for _ in range(batch)))
    cfg = OUT / f"plan-{release}.yaml"
    cfg.write_text(
        f"model: {{path: {store}}}\n"
        f"data: {{path: {rows}, format: tokens, max_seq_len: {seq}}}\n"
        f"train: {{steps: 4, batch_size: {batch}, micro_batch_size: 1}}\n"
        f"optim: {{lr: 1.0e-4, grad_clip: {clip}, grad_release: '{'true' if release == 'on' else 'false'}'}}\n"
        "engine: {device: cpu, dtype: float32, keep_activations: 0}\n"
        f"output: {{dir: {OUT / 'plan-run'}}}\n"
    )
    js = OUT / f"plan-{release}.json"
    cmd = [sys.executable, "-m", "horizon_cli.cli", "train", str(cfg), "--dry-run", "--json", str(js)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(js.read_text())


def child(store: str, release: str, clip: float, steps: int, batch: int, seq: int) -> dict:
    import torch

    from horizon_cli.config.schema import EngineConfig, OptimConfig
    from horizon_cli.data.batch import MicroBatch
    from horizon_cli.engine import Engine
    from horizon_cli.store import Store

    st = Store.open(Path(store))
    ecfg = EngineConfig(device="cpu", dtype="float32", keep_activations=0)
    ocfg = OptimConfig(lr=1e-4, grad_clip=clip, grad_release="true" if release == "on" else "false")
    eng = Engine(st, ecfg, ocfg, max_tokens=batch * seq)
    g = torch.Generator().manual_seed(0)
    times = []
    try:
        for _ in range(steps):
            rows = [torch.randint(0, st.arch.vocab, (seq,), generator=g).tolist() for _ in range(batch)]
            mbs = [MicroBatch.from_rows([(r, r) for r in rows[i : i + 1]], 0) for i in range(batch)]
            t0 = time.perf_counter()
            eng.step(mbs, 1e-4)
            eng.wait()
            times.append(time.perf_counter() - t0)
    finally:
        eng.close()
    pool = eng.host.pool.nbytes() if eng.host.pool is not None else 0
    return {
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
        "numel": sum(u.stream.numel() for u in eng.host.units.values()),
        "largest": max(u.stream.numel() for u in eng.host.units.values()),
        "pool_bytes": pool,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)  # micro-batches of one row
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", nargs=3)
    ap.add_argument("--json", type=Path, default=OUT / "result.json")
    a = ap.parse_args()
    if a.child:
        store, release, clip = a.child
        print(json.dumps(child(store, release, float(clip), a.steps, a.batch, a.seq)))
        return
    shape = {"hidden": 768, "intermediate": 2048, "layers": a.layers, "heads": 12, "vocab": 32000}
    store = prepare(shape, a.seq)
    plans = {r: plan(store, r, 0.0, a.batch, a.seq) for r in ("off", "on")}
    grads = {r: sum(v for k, v in p["host"].items() if k.startswith("gradients")) for r, p in plans.items()}
    samples: dict[tuple[str, float], list[dict]] = {c: [] for c in CASES}
    load = [os.getloadavg()[0]]
    for _ in range(a.repeats):
        for release, clip in CASES:
            cmd = [sys.executable, __file__, "--child", str(store), release, str(clip)]
            cmd += ["--steps", str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq)]
            r = json.loads(
                subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
            )
            samples[(release, clip)].append(r)
            load.append(os.getloadavg()[0])
    first = samples[("off", 0.0)][0]
    numel, largest = first["numel"], first["largest"]
    print(f"{numel / 1e6:.1f}M parameters, largest unit {largest / 1e6:.1f}M, batch {a.batch} x {a.seq}")
    print(
        f"plan host gradients (horizon train --dry-run --json): without release {grads['off'] / 2**20:.0f} MiB, "
        f"with {grads['on'] / 2**20:.0f} MiB: {(grads['off'] - grads['on']) / 2**20:.0f} MiB less; "
        f"plan host total {plans['off']['host_bytes'] / 2**20:.0f} -> {plans['on']['host_bytes'] / 2**20:.0f} MiB"
    )
    print(f"load average (1 min) over the run: {min(load):.1f} to {max(load):.1f}")
    out = {"shape": shape, "batch": a.batch, "seq": a.seq, "steps": a.steps, "plan_grad_bytes": grads}
    out["load"] = load
    out["cases"] = []
    for (release, clip), rs in samples.items():
        rss = statistics.median(r["peak_rss"] for r in rs)
        step = statistics.median(r["step_s"] for r in rs)
        steps = " ".join(f"{r['step_s']:.2f}" for r in rs)
        print(
            f"release {release:>3} grad_clip {clip}: peak RSS {rss / 2**20:,.0f} MiB (median of {len(rs)}), "
            f"step {step:.2f} s (median; samples {steps}), pool {rs[0]['pool_bytes'] / 2**20:.0f} MiB"
        )
        out["cases"].append({"release": release, "grad_clip": clip, "samples": rs})
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
