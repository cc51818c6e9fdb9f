"""Scale study: the deepest Llama-shaped model (width fixed, depth searched) that horizon, HF and
DeepSpeed can each take `--steps` training steps on within a memory limit on this machine.

    .venv/bin/python benchmarks/bench_scale.py                 # hidden 2048, bf16, limit 20 GiB
    .venv/bin/python benchmarks/bench_scale.py --peers horizon --probes 2,4 --limit-gib 8   # quicker
    .venv/bin/python benchmarks/bench_scale.py --peers horizon --lora [--quantize nf4] --keep 1 --limit-gib 19.5
    .venv/bin/python benchmarks/bench_scale.py --peers horizon --memory lean   # horizon with optim.memory: lean
    .venv/bin/python benchmarks/bench_scale.py --peers horizon,deepspeed --preference dpo --batch 2   # DPO, a pair a step

Peers as in benchmarks/bench_peers.py (horizon through Engine.step, no checkpoint: writing a multi-GB one
would dominate; hf resident + checkpointing + fused AdamW; deepspeed ZeRO-3 offload). Each
attempt runs in a process of its own, one at a time, watched by benchmarks/runner.py: it is
killed when its RSS passes --limit-gib (a safety margin below the machine's 24 GiB; other work
shares it) or the machine's available memory drops under 1 GiB. An attempt passes when every
step completes under the limit.

Search per peer: two small probe depths fit peak RSS = a + b * depth (memory is linear in depth),
the fit predicts the deepest passing depth, and attempts around it (then bisection) settle it.
Checkpoints are random (normal(0, 0.02)) bf16 safetensors written tensor by tensor
(benchmarks/prepare.py), converted to a bf16 horizon store; all peers load the same files.

--preference dpo: rows 2k, 2k+1 are a pair (the second given the first's first half: one prompt,
two completions of seq/2 tokens); horizon trains them with its DPO objective and streamed reference
pass, deepspeed with TRL's DPOTrainer under ZeRO-3 offload (benchmarks/ds_dpo.py). No hf peer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import psutil
from common import make_rows, param_count, write_rows
from runner import ROOT, GiB, child_env, exit_on_sigterm, run_child, run_peer

PEER_SCRIPT = {"horizon": "horizon", "hf": "hf", "deepspeed": "ds"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="horizon,hf,deepspeed")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--memory", default="exact", choices=("exact", "lean"), help="horizon's optim.memory")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probes", default="2,6", help="two small depths that fit the linear memory model")
    ap.add_argument("--max-depth", type=int, default=96)
    ap.add_argument("--limit-gib", type=float, default=20.0, help="kill an attempt whose RSS passes this")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per attempt")
    ap.add_argument("--work", type=Path, default=ROOT / "bench_out" / "scale")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "scale.json")
    ap.add_argument("--keep-models", action="store_true", help="keep the generated checkpoints")
    ap.add_argument("--lora", action="store_true", help="horizon: LoRA r 16 on every linear layer")
    ap.add_argument("--quantize", default="", choices=("", "nf4"), help="horizon: an NF4 store (with --lora)")
    ap.add_argument("--keep", type=int, default=3, help="generated models kept on disk at once")
    ap.add_argument(
        "--preference", default="", choices=("", "dpo"),
        help="DPO on pairs of rows (--batch counts sequences: 2 = one pair), reference included (horizon, deepspeed)",
    )  # fmt: skip
    ap.add_argument("--ds-zero", type=json.loads, default={}, help="deepspeed: zero_optimization keys (JSON)")
    args = ap.parse_args(argv)
    if args.preference and ("hf" in args.peers.split(",") or args.batch % 2):
        ap.error("--preference: peers horizon and deepspeed only, and an even --batch (pairs)")
    return args


class Models:
    """Random checkpoints + stores by depth, generated on demand; at most `keep` on disk."""

    def __init__(self, args, keep: int = 3):
        self.args, self.keep, self.order = args, keep, []

    def shape(self, depth: int) -> dict:
        a = self.args
        return dict(hidden=a.hidden, layers=depth, vocab=a.vocab, intermediate=a.intermediate, heads=a.heads)

    def get(self, depth: int) -> dict:
        d = self.args.work / f"d{depth}"
        job = {"shape": self.shape(depth), "seq": self.args.seq, "hf_dir": str(d / "hf"), "store": str(d / "store"),
               "store_dtype": "bfloat16", "hf_dtype": "bfloat16", "how": "stream", "seed": 0}  # fmt: skip
        if self.args.quantize or self.args.peers == "horizon":  # store only (other peers read hf/)
            job.update(quantize=self.args.quantize, drop_hf=True)
        ok = d / "store.ok"
        if not ok.is_file() or json.loads(ok.read_text()) != job:
            for old in self.order[: max(0, len(self.order) - self.keep + 1)]:
                shutil.rmtree(self.args.work / f"d{old}", ignore_errors=True)
                self.order.remove(old)
            print(
                f"  generating depth {depth} ({param_count(job['shape']) / 1e9:.2f} B params) ...", flush=True
            )
            d.mkdir(parents=True, exist_ok=True)
            (d / "prepare.json").write_text(json.dumps(job))
            cmd = [sys.executable, str(ROOT / "benchmarks/prepare.py"), str(d / "prepare.json")]
            c = run_child(
                cmd,
                d / "prepare.log",
                child_env(self.args.threads),
                limit_bytes=int(self.args.limit_gib * GiB),
            )
            if c.rc != 0 or not ok.is_file():
                raise SystemExit(
                    f"generating depth {depth} failed: {c.killed or 'see ' + str(d / 'prepare.log')}"
                )
        if depth in self.order:
            self.order.remove(depth)
        self.order.append(depth)
        return {"hf_dir": job["hf_dir"], "store": job["store"]}

    def clear(self) -> None:
        for depth in self.order:
            shutil.rmtree(self.args.work / f"d{depth}", ignore_errors=True)


def wait_for_memory(need: int, max_wait: float = 600) -> None:
    """Start a big attempt only when the machine has room for it (other work shares it)."""
    t0 = time.time()
    while psutil.virtual_memory().available < need and time.time() - t0 < max_wait:
        time.sleep(5)


def attempt(peer: str, depth: int, args, models: Models, data: Path) -> dict:
    paths = models.get(depth)
    o = {
        "lr": 1e-4,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "memory": args.memory,
    }
    job = {**paths, "data": str(data), "dtype": args.dtype, "steps": args.steps, "threads": args.threads,
           "batch": args.batch, "seq": args.seq, "micro": args.batch, "optim": o, "driver": "engine",
           "tag": f"{peer}-d{depth}"}  # fmt: skip
    if args.lora:
        job["lora"] = {"r": 16, "alpha": 32, "targets": "all-linear"}
    if args.preference:
        job["preference"] = args.preference
    if args.ds_zero:
        job["zero"] = args.ds_zero
    limit = int(args.limit_gib * GiB)
    wait_for_memory(limit + GiB)
    r = run_peer(PEER_SCRIPT[peer], job, args.work / "runs", limit_bytes=limit, timeout_s=args.timeout)
    passed = bool(r.get("ok")) and not r["killed"] and len(r.get("losses", [])) == args.steps
    rec = {"peer": peer, "depth": depth, "params": param_count(models.shape(depth)), "passed": passed,
           "peak_rss": r["peak_rss"], "killed": r["killed"], "error": r.get("error", ""),
           "losses": r.get("losses"), "step_s": r.get("step_s"), "wall_s": r["child_wall_s"],
           "plan": r.get("plan")}  # fmt: skip
    why = "" if passed else f"  ({r['killed'] or r.get('error', '')})"
    print(f"  {peer} depth {depth}: {'pass' if passed else 'FAIL'}, peak RSS {r['peak_rss'] / GiB:.2f} GiB, "
          f"{r['child_wall_s']:.0f} s{why}", flush=True)  # fmt: skip
    return rec


def search(peer: str, args, models: Models, data: Path, log: list) -> dict:
    """Deepest passing depth for one peer: linear fit from the probes, then local search/bisection."""
    limit = args.limit_gib * GiB
    tried: dict[int, dict] = {}

    def run(d: int) -> bool:
        if d not in tried:
            tried[d] = attempt(peer, d, args, models, data)
            log.append(tried[d])
        return tried[d]["passed"]

    p1, p2 = (int(x) for x in args.probes.split(","))
    if not (run(p1) and run(p2)):
        ok = [d for d in (p1, p2) if tried[d]["passed"]]
        if not ok or tried[p2]["killed"] == "" and tried[p2]["error"]:
            return {"peer": peer, "max_depth": max(ok, default=None), "fit": None,
                    "attempts": {str(k): v for k, v in tried.items()}}  # fmt: skip
    b = (tried[p2]["peak_rss"] - tried[p1]["peak_rss"]) / (p2 - p1)  # bytes per layer
    a = tried[p1]["peak_rss"] - b * p1
    guess = max(p2, min(args.max_depth, int((limit - a) // b)))
    lo = max(d for d in tried if tried[d]["passed"])  # deepest pass
    hi: int | None = None  # shallowest fail (for want of memory)
    d, moves = guess, 0
    while d not in tried or d == guess:
        if run(d):
            lo = max(lo, d)
        elif tried[d]["killed"] or "memory" in tried[d]["error"].lower():
            hi = d if hi is None else min(hi, d)
        else:  # failed for another reason: report it rather than guess
            break
        if (hi is not None and hi - lo <= 1) or lo >= args.max_depth:
            break
        moves += 1  # the fit is usually exact: step next to it first, then bisect
        if hi is None:
            d = lo + 1 if moves <= 3 else min(args.max_depth, 2 * lo)
        else:
            d = hi - 1 if moves <= 3 and hi - 1 > lo else (lo + hi) // 2
    return {"peer": peer, "max_depth": lo, "first_fail": hi, "fit": {"a_bytes": a, "b_bytes_per_layer": b,
            "predicted_depth": guess}, "attempts": {str(k): v for k, v in tried.items()}}  # fmt: skip


def main(argv=None) -> None:
    args = parse_args(argv)
    exit_on_sigterm()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = make_rows(args.batch * args.steps, args.seq, args.vocab, seed=1)
    if args.preference:  # a pair's two rows share the prompt half, as TRL's pairs do
        for k in range(0, len(rows), 2):
            rows[k + 1][: args.seq // 2] = rows[k][: args.seq // 2]
    data = args.work / f"rows-{args.batch * args.steps}x{args.seq}{'-pairs' if args.preference else ''}.jsonl"
    write_rows(rows, data)
    models, log, out = Models(args, keep=args.keep), [], []
    t0 = time.perf_counter()
    try:
        for peer in args.peers.split(","):
            print(f"[{peer}]", flush=True)
            out.append(search(peer, args, models, data, log))
            s = out[-1]
            if s["max_depth"]:
                n = param_count(models.shape(s["max_depth"]))
                print(f"[{peer}] deepest passing depth {s['max_depth']} ({n / 1e9:.2f} B params)", flush=True)
    finally:
        if not args.keep_models:
            models.clear()
    summary = []
    for s in out:
        d = s["max_depth"]
        n = param_count(models.shape(d)) if d else None
        summary.append({"peer": s["peer"], "max_depth": d, "params": n, "first_fail": s.get("first_fail"),
                        "peak_rss": s["attempts"][str(d)]["peak_rss"] if d else None})  # fmt: skip
    by = {s["peer"]: s for s in summary}
    ratios = {
        f"horizon/{p}": by["horizon"]["params"] / by[p]["params"]
        for p in by
        if p != "horizon" and "horizon" in by and by["horizon"]["params"] and by[p]["params"]
    }
    res = {"command": " ".join([".venv/bin/python", "benchmarks/bench_scale.py", *(argv or sys.argv[1:])]),
           "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "summary": summary, "ratios": ratios, "searches": out, "wall_s": time.perf_counter() - t0}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))
    print(
        "\n| peer | deepest depth | params | peak RSS GiB | B/param | first failing depth |\n|---|---|---|---|---|---|"
    )
    for s in summary:
        if s["params"]:
            print(f"| {s['peer']} | {s['max_depth']} | {s['params'] / 1e9:.2f} B | {s['peak_rss'] / GiB:.2f} "
                  f"| {s['peak_rss'] / s['params']:.1f} | {s['first_fail']} |")  # fmt: skip
        else:
            print(f"| {s['peer']} | none | - | - | - | {s['first_fail']} |")
    print("\n" + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) + f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
