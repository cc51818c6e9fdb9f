"""Side-by-side training benchmark: horizon against the peers a user would otherwise pick.

    .venv/bin/python benchmarks/bench_peers.py                       # `make bench`: the default set below
    .venv/bin/python benchmarks/bench_peers.py --sizes 30m --dtypes float32 --steps 4   # a quick run

The same Llama-shaped model (transformers' random init, seed 0), the same token rows, the same
thread count, trained in one run by
  horizon    `horizon train` (benchmarks/horizon_peer.py; --horizon-driver engine: Engine.step),
             engine.keep_activations: auto (on the CPU with room to spare: every layer kept)
  horizon-recompute  the same with engine.keep_activations: 0 (every layer recomputed, loaded twice)
  hf         transformers, resident, gradient checkpointing, torch.optim.AdamW(fused=True)
  deepspeed  DeepSpeed ZeRO-3, offload_param + offload_optimizer to the CPU, DeepSpeedCPUAdam
each in a process of its own (benchmarks/runner.py). Same lr/betas/eps/weight decay/clip,
constant lr, batch 4 x seq 256 (no padding), micro-batch 4 for every peer (the whole batch: each
peer's natural choice at this size, one optimizer step per forward/backward).

tokens/s: non-padding input tokens per second of wall time, summed over the steps after the
first --warmup step(s). Peak RSS: the process's high-water mark (ru_maxrss), setup included.
B/param: peak RSS / parameters; horizon's plan figure is planning.memory.memory_plan's state bytes
per parameter. Loss agreement: each peer's per-step loss against hf's at the same dtype.

Then one decoder layer alone, horizon's functional layer against transformers' own
(benchmarks/bench_layer.py, --layer-repeat rounds, 0 skips it): the per-phase comparison, timed by one
compute thread's CPU time so that other work on a shared machine does not decide it.

Writes --json (default bench_out/bench.json) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from common import SHAPES, make_rows, write_rows
from runner import ROOT, GiB, child_env, exit_on_sigterm, run_child, run_peer

PEERS = ("horizon", "hf", "deepspeed", "hf-pure", "horizon-recompute")
PEER_SCRIPT = {
    "horizon": "horizon",
    "hf": "hf",
    "deepspeed": "ds",
    "hf-pure": "hf",
    "horizon-recompute": "horizon",
}
DEFAULT_PEERS = "horizon,hf,deepspeed"
DEFAULT_STEPS = {"30m": 6, "120m": 4}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="30m,120m", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument(
        "--peers",
        default=DEFAULT_PEERS,
        help=f"comma list of {', '.join(PEERS)} (hf-pure: bf16 weights and AdamW state, no fp32 master; bf16 only)",
    )
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps per run (0: 6 for 30m, 4 for 120m)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per peer, interleaved; the best is kept")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of tokens/s")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op / OpenMP threads, every peer")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4, help="rows per micro-batch, every peer")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--horizon-driver", choices=("cli", "engine"), default="cli")
    ap.add_argument("--work", type=Path, default=ROOT / "bench_out" / "work")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "bench.json")
    ap.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=0,
        help="set glibc's MALLOC_MMAP_THRESHOLD_ (bytes) in every peer (0: glibc's dynamic default)",
    )
    ap.add_argument(
        "--horizon-malloc-trim",
        action="store_true",
        help="experiment, --horizon-driver engine only: glibc malloc_trim(0) after setup and each step",
    )
    ap.add_argument(
        "--layer-repeat", type=int, default=20, help="rounds of the one-layer comparison (0: skip)"
    )
    ap.add_argument("--report", type=Path, help="print the tables of an earlier --json file and exit")
    ap.add_argument("--limit-gib", type=float, default=20.0, help="kill a peer whose RSS passes this")
    return ap.parse_args(argv)


def prepare(size: str, args, steps: int) -> dict:
    """HF checkpoint (fp32), an fp32 horizon store of it and the token rows, cached under --work."""
    d = args.work / size
    job = {"shape": SHAPES[size], "seq": args.seq, "hf_dir": str(d / "hf"), "store": str(d / "store"),
           "store_dtype": "float32", "hf_dtype": "float32", "how": "init", "seed": 0, "tokenizer": True}  # fmt: skip
    ok = d / "store.ok"
    if not ok.is_file() or json.loads(ok.read_text()) != job:
        print(f"[{size}] building the random checkpoint and its store ...", flush=True)
        d.mkdir(parents=True, exist_ok=True)
        (d / "prepare.json").write_text(json.dumps(job))
        c = run_child([sys.executable, str(ROOT / "benchmarks/prepare.py"), str(d / "prepare.json")],
                      d / "prepare.log", child_env(args.threads))  # fmt: skip
        if c.rc != 0 or not ok.is_file():
            raise SystemExit(f"prepare {size} failed: see {d / 'prepare.log'}")
    rows = d / f"rows-v2-{args.batch * steps}x{args.seq}.jsonl"
    if not rows.is_file():
        write_rows(make_rows(args.batch * steps, args.seq, SHAPES[size]["vocab"], seed=1), rows)
    return {"hf_dir": job["hf_dir"], "store": job["store"], "data": str(rows)}


def tokens_per_s(r: dict, warmup: int) -> float | None:
    t, s = r.get("tokens", [])[warmup:], r.get("step_s", [])[warmup:]
    return sum(t) / sum(s) if s and sum(s) > 0 else None


def best_tokens_per_s(r: dict, warmup: int) -> float | None:
    """Tokens of the fastest step after warm-up / its time: the least disturbed by other work on a
    shared machine (as timeit reports the minimum)."""
    pairs = list(zip(r.get("tokens", [])[warmup:], r.get("step_s", [])[warmup:], strict=False))
    return max(t / s for t, s in pairs) if pairs else None


def best_runs(res: list[dict], warmup: int) -> list[dict]:
    """With --repeat: per (size, dtype, peer) the run with the best fastest-step tokens/s."""
    out: dict[tuple, dict] = {}
    for r in res:
        k = (r["size"], r["dtype"], r["peer"])
        score = best_tokens_per_s(r, warmup) if r.get("ok") else -1
        if k not in out or score > out[k][0]:
            out[k] = (score, r)
    return [r for _, r in out.values()]


def agreement(r: dict, ref: dict | None) -> dict:
    if not ref or not ref.get("ok") or not r.get("ok") or r is ref:
        return {}
    a, b = r["losses"], ref["losses"]
    d = [abs(x - y) for x, y in zip(a, b, strict=False) if x is not None and y is not None]
    return {"vs": ref["peer"], "step1_abs": d[0] if d else None, "max_abs": max(d) if d else None,
            "final_abs": d[-1] if d else None, "final_rel": d[-1] / abs(b[-1]) if d and b[-1] else None}  # fmt: skip


def summarize(res: list[dict], warmup: int) -> None:
    """Derived figures in place: tokens/s, B/param, agreement with hf, horizon/peer ratios."""
    for r in res:
        r["tokens_per_s"] = tokens_per_s(r, warmup) if r.get("ok") else None
        r["tokens_per_s_best"] = best_tokens_per_s(r, warmup) if r.get("ok") else None
        p = r.get("params")
        r["bytes_per_param"] = r["peak_rss"] / p if p and r.get("peak_rss") else None
    for r in res:
        same = [x for x in res if x["size"] == r["size"] and x["dtype"] == r["dtype"]]
        ref = next((x for x in same if x["peer"] == "hf"), None)
        r["agreement"] = agreement(r, ref)
        if r["peer"] == "horizon":
            for key, name in (("tokens_per_s", "ratios"), ("tokens_per_s_best", "ratios_best")):
                r[name] = {
                    x["peer"]: r[key] / x[key]
                    for x in same
                    if x["peer"] != "horizon" and r[key] and x.get(key)
                }


def fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def speed_table(res: list[dict]) -> str:
    head = ("| size | dtype | peer | params | micro | tokens/s | horizon ÷ peer | best-step tokens/s "
            "| horizon ÷ peer (best) | peak RSS GiB | RSS B/param "
            "| loss step 1 | loss last | max abs Δloss vs hf | other procs' CPU | note |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    hz = {(r["size"], r["dtype"]): r for r in res if r["peer"] == "horizon"}
    for r in res:
        h = hz.get((r["size"], r["dtype"]))
        ratio = h.get("ratios", {}).get(r["peer"]) if h and r["peer"] != "horizon" else None
        best = h.get("ratios_best", {}).get(r["peer"]) if h and r["peer"] != "horizon" else None
        ag = r.get("agreement", {})
        note = r.get("notes", "") if r.get("ok") else f"did not run: {r.get('error', '?')}"
        losses = r.get("losses") or [None]
        lines.append(
            f"| {r['size']} | {r['dtype']} | {r['peer']} | {fmt(r.get('params'), ',')} | {r.get('micro_batch', '-')} "
            f"| {fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(ratio, '.2f')} | {fmt(r.get('tokens_per_s_best'), ',.0f')} "
            f"| {fmt(best, '.2f')} | {fmt(r['peak_rss'] / GiB, '.2f')} "
            f"| {fmt(r.get('bytes_per_param'), '.1f')} | {fmt(losses[0], '.4f')} | {fmt(losses[-1], '.4f')} "
            f"| {fmt(ag.get('max_abs'), '.2e')} | {fmt(r.get('other_cpu_share'), '.0%')} | {note} |"
        )
    return "\n".join(lines)


def plan_table(res: list[dict]) -> str:
    """horizon's peak RSS against planning.memory.memory_plan. With engine.device cpu the plan's
    "device" buffers are host RAM too, so the comparison is against host + device; the Python,
    torch and transformers imports (measured before any model memory) are not in the plan."""
    lines = [
        "| size | dtype | params | plan state B/param | plan host GiB | plan device GiB | plan host+device GiB "
        "| imports GiB | peak RSS GiB | (peak − imports) ÷ (host+device) | peak B/param |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res:
        if r["peer"] != "horizon" or not r.get("ok"):
            continue
        p = r["plan"]
        both = p["host_total"] + p.get("device_total", 0)
        base = r.get("rss_imports", r["rss_baseline"])
        lines.append(
            f"| {r['size']} | {r['dtype']} | {p['params']:,} | {p['bytes_per_param']:.2f} | {p['host_total'] / GiB:.3f} "
            f"| {p.get('device_total', 0) / GiB:.3f} | {both / GiB:.3f} | {base / GiB:.3f} | {r['peak_rss'] / GiB:.3f} "
            f"| {(r['peak_rss'] - base) / both:.2f} | {r['peak_rss'] / p['params']:.1f} |"
        )
    return "\n".join(lines)


def layer_table(rows: list[dict]) -> str:
    """One decoder layer: horizon against transformers ("hf": fp32 weights, bf16 autocast in bf16
    runs, as in the peer table; "hf-pure": weights cast to bf16), per phase, in ms."""
    lines = ["| size | dtype | phase | horizon ms | hf ms | hf ÷ horizon | hf-pure ms | hf-pure ÷ horizon |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        pure = r.get("hf-pure")
        lines.append(
            f"| {r['size']} | {r['dtype']} | {r['phase']} | {r['horizon']:.2f} | {fmt(r.get('hf'), '.2f')} "
            f"| {fmt(r['hf'] / r['horizon'] if r.get('hf') else None, '.2f')} | {fmt(pure, '.2f')} "
            f"| {fmt(pure / r['horizon'] if pure else None, '.2f')} |"
        )
    return "\n".join(lines)


def run_layer_bench(args, sizes: list[str], dtypes: list[str]) -> list[dict]:
    out = args.json.parent / "layer.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_layer.py"), "--sizes", ",".join(sizes), "--dtypes",
           ",".join(dtypes), "--batch", str(args.batch), "--seq", str(args.seq), "--repeat",
           str(args.layer_repeat), "--json", str(out)]  # fmt: skip
    c = run_child(cmd, args.work / "layer.log", child_env(1))
    if c.rc != 0 or not out.is_file():
        print(f"layer benchmark failed: see {args.work / 'layer.log'}")
        return []
    return json.loads(out.read_text())["rows"]


def report(path: Path, warmup: int) -> None:
    data = json.loads(path.read_text())
    res = data["runs"]
    summarize(res, warmup)
    print(speed_table(res) + "\n\nhorizon memory plan against peak RSS:\n\n" + plan_table(res))
    if data.get("layer"):
        print("\none decoder layer (CPU time of one compute thread):\n\n" + layer_table(data["layer"]))


def main(argv=None) -> None:
    args = parse_args(argv)
    exit_on_sigterm()
    if args.report:
        return report(args.report, args.warmup)
    sizes, dtypes = args.sizes.split(","), args.dtypes.split(",")
    peers = [p for p in args.peers.split(",") if p]
    bad = [s for s in sizes if s not in SHAPES] + [p for p in peers if p not in PEERS]
    if bad:
        raise SystemExit(f"unknown size or peer: {bad}")
    if args.malloc_mmap_threshold:  # inherited by every child (runner.child_env copies os.environ)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    t0, res = time.perf_counter(), []
    optim = {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": args.weight_decay,
             "grad_clip": args.grad_clip}  # fmt: skip
    for size in sizes:
        steps = args.steps or DEFAULT_STEPS[size]
        paths = prepare(size, args, steps)
        for dtype in dtypes:
            for rep, peer in ((rep, peer) for rep in range(args.repeat) for peer in peers):  # interleaved
                if peer == "hf-pure" and dtype != "bfloat16":
                    continue  # the same as hf in fp32
                job = {"pure": peer == "hf-pure", "keep": 0 if peer == "horizon-recompute" else "auto", "malloc_trim": args.horizon_malloc_trim, **paths, "dtype": dtype, "steps": steps, "threads": args.threads, "batch": args.batch,
                       "seq": args.seq, "micro": args.micro, "optim": optim, "driver": args.horizon_driver,
                       "tag": f"{peer}-{dtype}-{rep}"}  # fmt: skip
                r = run_peer(
                    PEER_SCRIPT[peer], job, args.work / size / "runs", limit_bytes=int(args.limit_gib * GiB)
                )
                r.update(size=size, peer=peer, steps=steps, rep=rep)
                res.append(r)
                tps = tokens_per_s(r, args.warmup) if r.get("ok") else None
                print(f"[{size} {dtype} {peer}] " + (f"{tps:,.0f} tok/s, peak RSS {r['peak_rss'] / GiB:.2f} GiB, "
                      f"losses {[round(x, 4) for x in r['losses']]}" if tps else f"failed: {r.get('error')}")
                      + f" ({r['child_wall_s']:.0f} s)", flush=True)  # fmt: skip
    every = res
    res = best_runs(res, args.warmup)
    summarize(res, args.warmup)
    layer = run_layer_bench(args, sizes, dtypes) if args.layer_repeat else []
    out = {
        "command": " ".join(
            [".venv/bin/python", "benchmarks/bench_peers.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "optim": optim,
        "wall_s": time.perf_counter() - t0,
        "runs": [{k: v for k, v in r.items() if k != "traceback"} for r in res],
        "all_runs": [{k: v for k, v in r.items() if k != "traceback"} for r in every]
        if args.repeat > 1
        else [],
        "layer": layer,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print("\n" + speed_table(res) + "\n\nhorizon memory plan against peak RSS:\n\n" + plan_table(res))
    if layer:
        print("\none decoder layer (CPU time of one compute thread):\n\n" + layer_table(layer))
    print(f"\nwrote {args.json} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
