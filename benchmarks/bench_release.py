"""Gradient release (optim.grad_release, issue 39) on the CPU: peak RSS and step time with and without.

    .venv/bin/python benchmarks/bench_release.py                   # ~162M Llama shape, fp32 exact
    .venv/bin/python benchmarks/bench_release.py --layers 4 --steps 3 --repeats 1   # quick

Builds a random Llama-shaped fp32 store once (benchmarks/prepare.py, `bench_out/release/`), then
runs each case in a fresh child process (Engine.step, `device: cpu`, no checkpoint): its peak RSS
(ru_maxrss) and its median step time after the first step. Cases: release off / on at
grad_clip 0 (one pass), and off / on at grad_clip 1 (release: the norm-first pass), interleaved
`--repeats` times (the machine is shared: the best of the repeats is reported). The plan's host
gradient bytes: every unit's fp32 gradient without release (4 B/param), RELEASE_BUFFERS buffers
the size of the largest unit's with it.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from horizon_cli.optim.modes import RELEASE_BUFFERS

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
    a = ap.parse_args()
    if a.child:
        store, release, clip = a.child
        print(json.dumps(child(store, release, float(clip), a.steps, a.batch, a.seq)))
        return
    shape = {"hidden": 768, "intermediate": 2048, "layers": a.layers, "heads": 12, "vocab": 32000}
    store = prepare(shape, a.seq)
    best: dict[tuple[str, float], dict] = {}
    for _ in range(a.repeats):
        for release, clip in CASES:
            cmd = [sys.executable, __file__, "--child", str(store), release, str(clip)]
            cmd += ["--steps", str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq)]
            r = json.loads(
                subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
            )
            b = best.setdefault((release, clip), r)
            b["step_s"], b["peak_rss"] = min(b["step_s"], r["step_s"]), min(b["peak_rss"], r["peak_rss"])
    numel = best[("off", 0.0)]["numel"]
    largest = best[("off", 0.0)]["largest"]
    print(f"{numel / 1e6:.1f}M parameters, largest unit {largest / 1e6:.1f}M, batch {a.batch} x {a.seq}")
    off, on = numel * 4 / 2**20, RELEASE_BUFFERS * largest * 4 / 2**20
    print(f"plan host gradients: without release {off:.0f} MiB, with {on:.0f} MiB")
    for (release, clip), r in best.items():
        print(
            f"release {release:>3} grad_clip {clip}: peak RSS {r['peak_rss'] / 2**20:,.0f} MiB, "
            f"step {r['step_s']:.2f} s, pool {r['pool_bytes'] / 2**20:.0f} MiB"
        )


if __name__ == "__main__":
    main()
