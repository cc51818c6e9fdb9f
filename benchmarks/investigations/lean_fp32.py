"""`optim.memory: lean` against `exact`, computing in fp32 and in bf16, on SmolLM2 with real text
(issue 43 item 8): four runs of one config that differ only in optim.memory and engine.dtype.

    make smollm2                                   # the model, offline (scripts/smollm2.py)
    python -m benchmarks.investigations.lean_fp32 [--store .cache/smollm2/store] [--steps 30]

Data: the project's own docs (README.md, docs/*.md): paragraphs of 400..1200 characters, format
text, 4 x 128 tokens a step, lr 1e-4 constant, seed 0. Prints each run's losses and the relative
gaps of their mean losses over steps 2-12 and 21-30 (bench_out/lean_fp32.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("exact-float32", "lean-float32", "exact-bfloat16", "lean-bfloat16")


def write_inputs(out: Path, store: str, steps: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    paras = []
    for f in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        paras += [p.strip() for p in f.read_text().split("\n\n") if 400 <= len(p.strip()) <= 1200]
    paras = [p for p in paras if not p.startswith(("|", "```", "#"))]
    (out / "text.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paras[:200]))
    for name in RUNS:
        mem, dtype = name.split("-")
        cfg = {"model": {"path": store}, "data": {"path": str(out / "text.jsonl"), "format": "text", "max_seq_len": 128},
               "train": {"steps": steps, "batch_size": 4, "micro_batch_size": 4, "seed": 0},
               "optim": {"lr": 1e-4, "memory": mem, "weight_decay": 0.0, "grad_clip": 1.0},
               "schedule": {"kind": "constant", "warmup_steps": 0}, "engine": {"device": "cpu", "dtype": dtype},
               "output": {"dir": str(out / f"run-{name}"), "save_every": 0, "export": False},
               "log": {"every": 1, "plot": False}}  # fmt: skip
        (out / f"{name}.yaml").write_text(yaml.safe_dump(cfg))


def losses(out: Path, name: str) -> dict[int, float]:
    rows = [json.loads(ln) for ln in (out / f"run-{name}" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "step" in r and r.get("loss") is not None}


def gap(a: dict, b: dict, lo: int, hi: int) -> float | None:
    ks = [k for k in range(lo, hi + 1) if k in a and k in b]
    if not ks:
        return None
    ma, mb = sum(a[k] for k in ks) / len(ks), sum(b[k] for k in ks) / len(ks)
    return 100 * (ma - mb) / mb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=str(ROOT / ".cache" / "smollm2" / "store"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "lean_fp32"))
    a = ap.parse_args()
    out = Path(a.out)
    write_inputs(out, a.store, a.steps)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for pair in (RUNS[:2], RUNS[2:]):  # side by side, one thread each: load falls on both alike
        procs = [subprocess.Popen([sys.executable, "-m", "horizon_cli", "train", str(out / f"{n}.yaml")], env=env,
                                  stdout=subprocess.DEVNULL) for n in pair]  # fmt: skip
        if any(p.wait() for p in procs):
            sys.exit("a run failed")
    got = {n: losses(out, n) for n in RUNS}
    pairs = [("lean-float32", "exact-float32"), ("lean-bfloat16", "exact-bfloat16"),
             ("exact-bfloat16", "exact-float32"), ("lean-float32", "exact-bfloat16")]  # fmt: skip
    result = {f"{x} vs {y}": {f"{lo}-{hi}": gap(got[x], got[y], lo, hi) for lo, hi in ((2, 12), (21, 30))}
              for x, y in pairs}  # fmt: skip
    print(json.dumps(result, indent=1))
    (ROOT / "bench_out").mkdir(exist_ok=True)
    (ROOT / "bench_out" / "lean_fp32.json").write_text(
        json.dumps({"gaps_percent": result, "losses": got}, indent=1)
    )


if __name__ == "__main__":
    main()
