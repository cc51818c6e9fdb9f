"""The largest model GRPO trains on this machine (issue 29): horizon against TRL's GRPOTrainer with
DeepSpeed ZeRO-3 offload to the CPU, on a ladder of Llama-shaped models of one width.

    .venv/bin/python benchmarks/bench_grpo_peer.py --peer-python bench_out/peer-venv/bin/python
    .venv/bin/python benchmarks/bench_grpo_peer.py --peers horizon --depths 1,2 --limit-gib 4   # quick

The ladder: hidden 2048, intermediate 5632, 16 heads, vocab 32000 (benchmarks/bench_scale.py's
width), depth from --depths, random normal(0, 0.02) bf16 checkpoints written tensor by tensor and
converted to a bf16 horizon store (benchmarks/prepare.py); both peers load the same files. Each
step: --prompts random prompts of --prompt-len token ids x G completions of up to --new tokens
sampled at temperature 1, benchmarks/grpo_reward.py's reward (both peers call it), loss_type dapo, beta 0
(TRL's default: no reference), the whole batch in one micro-batch unless --micro, AdamW lr 1e-5,
betas (0.9, 0.999), clip 1.0, constant lr, bf16, --steps steps.

horizon    `horizon train` with an `rl:` section (engine.device cpu, dtype bfloat16,
           keep_activations 0: every layer recomputed, as the TRL peer's gradient checkpointing;
           on the CPU a kept layer's graph is host RAM too), and its `--dry-run --json` plan of the
           same config (host and device bytes, both host RAM here)
trl        TRL's GRPOTrainer under ZeRO-3 offload of parameters and optimizer (benchmarks/trl_grpo_peer.py),
           run by --peer-python: an environment with DeepSpeed, kept out of horizon's own

Every attempt is a process of its own, one at a time, watched by benchmarks/runner.py: killed when
its RSS passes --limit-gib, when the machine's available memory falls under 1 GiB, or after
--timeout s. An attempt "fits" when every step completes under the limit; a peer's ladder stops
at its first attempt that does not. Peak RSS: the kernel's high-water mark of the process (wait4).
The 1-minute load average is recorded before and after each attempt (the machine is shared).
Writes --json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import yaml
from bench_scale import Models, wait_for_memory
from common import param_count
from runner import ROOT, GiB, child_env, exit_on_sigterm, run_child, run_peer

OPTIM = {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "grad_clip": 1.0}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="horizon,trl")
    ap.add_argument("--peer-python", default=str(ROOT / "bench_out/peer-venv/bin/python"))
    ap.add_argument("--depths", default="2,4,6,9,12,15", help="the ladder, ascending")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=4, help="prompts a step")
    ap.add_argument("--G", type=int, default=4, help="num_generations")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=32, help="max_completion_length")
    ap.add_argument("--micro", type=int, default=0, help="completions per micro-batch (0: the whole batch)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit-gib", type=float, default=12.0, help="kill an attempt whose RSS passes this")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per attempt")
    ap.add_argument("--work", type=Path, default=ROOT / "bench_out" / "grpo-peer")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "grpo-peer.json")
    a = ap.parse_args(argv)
    a.micro = a.micro or a.prompts * a.G
    # what bench_scale.Models reads: the shape, bf16 files, no quantization, hf/ kept for trl
    a.seq, a.quantize, a.keep = a.prompt_len + a.new, "", 1
    return a


def load() -> float:
    return os.getloadavg()[0]


def write_prompts(a, path: Path) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    ids = [
        torch.randint(3, a.vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts * a.steps)
    ]
    path.write_text("".join(json.dumps({"prompt_input_ids": p}) + "\n" for p in ids))
    return ids


def horizon_config(a, store: str, prompts: Path, run: Path) -> Path:
    cfg = {
        "model": {"path": store},
        "data": {"path": str(prompts), "format": "prompt", "max_seq_len": a.seq, "shuffle": False},
        "train": {"steps": a.steps, "batch_size": a.prompts, "micro_batch_size": a.micro, "seed": 0},
        "optim": dict(OPTIM),
        "schedule": {"kind": "constant", "warmup_steps": 0},
        "engine": {"device": "cpu", "dtype": "bfloat16", "keep_activations": 0},
        "output": {"dir": str(run), "export": False, "save_every": 0},
        "log": {"every": 1, "plot": False},
        "rl": {"loss_type": "dapo", "num_generations": a.G, "max_completion_length": a.new, "beta": 0.0,
               "rewards": [{"function": f"{ROOT / 'benchmarks/grpo_reward.py'}:even_share"}]},
    }  # fmt: skip
    path = run.parent / f"{run.name}.yaml"
    path.write_text(f"# .venv/bin/horizon train {path}\n" + yaml.safe_dump(cfg, sort_keys=False))
    return path


def horizon_attempt(a, depth: int, paths: dict, prompts: Path) -> dict:
    runs = a.work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run = runs / f"horizon-d{depth}"
    shutil.rmtree(run, ignore_errors=True)
    cfg = horizon_config(a, paths["store"], prompts, run)
    env, cmd = child_env(a.threads), [sys.executable, "-m", "horizon_cli", "train", str(cfg)]
    plan_path = runs / f"horizon-d{depth}.plan.json"
    c = run_child([*cmd, "--dry-run", "--json", str(plan_path)], runs / f"horizon-d{depth}.plan.log", env)
    plan = json.loads(plan_path.read_text()) if c.rc == 0 and plan_path.is_file() else {}
    c = run_child(
        cmd, runs / f"horizon-d{depth}.log", env, limit_bytes=int(a.limit_gib * GiB), timeout_s=a.timeout
    )
    m = run / "metrics.jsonl"
    rows = [json.loads(x) for x in m.read_text().splitlines() if x.strip()] if m.is_file() else []
    shutil.rmtree(run, ignore_errors=True)  # the final checkpoint: GBs
    keys = (
        "step_s",
        "rollout_s",
        "reference_s",
        "engine_s",
        "rollout_tokens_per_s",
        "host_rss_bytes",
        "loss",
        "reward",
    )
    res = {k: [r.get(k) for r in rows] for k in keys}
    error = c.killed or ("" if c.rc == 0 else f"exit status {c.rc} (see {runs / f'horizon-d{depth}.log'})")
    return {**res, "rc": c.rc, "killed": c.killed, "error": error, "peak_rss": c.peak_rss, "wall_s": c.wall_s,
            "other_cpu_share": c.others, "plan": {k: plan.get(k) for k in ("host_bytes", "device_bytes", "fits",
            "params", "host_bytes_per_param", "rollouts")}, "ok": c.rc == 0 and len(rows) == a.steps}  # fmt: skip


def trl_attempt(a, depth: int, paths: dict, prompt_ids: list[list[int]]) -> dict:
    job = {"hf_dir": paths["hf_dir"], "dtype": "bfloat16", "steps": a.steps, "threads": a.threads,
           "prompts": a.prompts, "G": a.G, "new": a.new, "micro": a.micro, "vocab": a.vocab,
           "prompt_ids": prompt_ids, "optim": OPTIM, "tag": f"trl-d{depth}"}  # fmt: skip
    r = run_peer("trl_grpo", job, a.work / "runs", python=a.peer_python, limit_bytes=int(a.limit_gib * GiB),
                 timeout_s=a.timeout)  # fmt: skip
    r["ok"] = bool(r.get("ok")) and not r["killed"] and len(r.get("step_s", [])) == a.steps
    r["wall_s"] = r.get("child_wall_s")
    r.pop("prompt_ids", None)
    return r


def ladder(a) -> list[dict]:
    a.work.mkdir(parents=True, exist_ok=True)
    prompts = a.work / f"prompts-{a.prompts * a.steps}x{a.prompt_len}.jsonl"
    prompt_ids = write_prompts(a, prompts)
    peers = a.peers.split(",")
    a.peers = "horizon" if peers == ["horizon"] else "horizon,trl"  # Models: drop hf/ when horizon alone
    models, out, done = Models(a, keep=a.keep), [], set()
    try:
        for depth in (int(x) for x in a.depths.split(",")):
            live = [p for p in peers if p not in done]
            if not live:
                break
            paths = models.get(depth)
            for peer in live:
                wait_for_memory(int(a.limit_gib * GiB) + GiB)
                l0, t0 = load(), time.strftime("%H:%M:%S", time.gmtime())
                r = (horizon_attempt(a, depth, paths, prompts) if peer == "horizon"
                     else trl_attempt(a, depth, paths, prompt_ids))  # fmt: skip
                r.update(peer=peer, depth=depth, params=param_count(models.shape(depth)), load_before=l0,
                         load_after=load(), started_utc=t0)  # fmt: skip
                out.append(r)
                save(a, out, partial=True)  # what is done so far survives an interrupted ladder
                steps = " ".join(f"{x:.1f}" for x in r.get("step_s") or [] if x is not None)
                print(f"[{peer} depth {depth} {r['params'] / 1e9:.2f} B] {'fits' if r['ok'] else 'DOES NOT FIT'}: "
                      f"peak RSS {r['peak_rss'] / GiB:.2f} GiB, steps {steps} s, load {l0:.1f}->{r['load_after']:.1f}"
                      + ("" if r["ok"] else f" ({r.get('error') or r.get('killed')})"), flush=True)  # fmt: skip
                if not r["ok"]:
                    done.add(peer)
    finally:
        models.clear()
    return out


def save(a, res: list[dict], **extra) -> dict:
    out = {"command": " ".join([".venv/bin/python", "benchmarks/bench_grpo_peer.py", *sys.argv[1:]]),
           "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
           "runs": [{k: v for k, v in r.items() if k != "traceback"} for r in res], **extra}  # fmt: skip
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))
    return out


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def last(xs) -> float | None:
    xs = [x for x in xs or [] if x is not None]
    return xs[-1] if xs else None


def table(res: list[dict]) -> str:
    lines = ["| depth | params | peer | fits | peak RSS GiB | B/param | plan host+device GiB | step s (last) "
             "| rollout s | train s | steps (s) | load 1-min before → after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res:
        p = r.get("plan") or {}
        both = (p.get("host_bytes") or 0) + (p.get("device_bytes") or 0) if p.get("host_bytes") else None
        if r["peer"] == "horizon":
            roll, train = last(r.get("rollout_s")), last(r.get("engine_s"))
        else:
            roll, train = last(r.get("generate_s")), None
            if last(r.get("step_s")) is not None and last(r.get("generate_and_score_s")) is not None:
                train = last(r["step_s"]) - last(r["generate_and_score_s"])
        why = "yes" if r["ok"] else f"no: {r.get('killed') or r.get('error', '?')}"
        lines.append(
            f"| {r['depth']} | {r['params'] / 1e9:.2f} B | {r['peer']} | {why} | {r['peak_rss'] / GiB:.2f} "
            f"| {r['peak_rss'] / r['params']:.1f} | {fmt(both / GiB if both else None, '.2f')} "
            f"| {fmt(last(r.get('step_s')), '.1f')} | {fmt(roll, '.1f')} | {fmt(train, '.1f')} "
            f"| {' '.join(fmt(x, '.1f') for x in r.get('step_s') or [])} "
            f"| {r['load_before']:.1f} → {r['load_after']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    a = parse_args(argv)
    exit_on_sigterm()
    t0 = time.perf_counter()
    res = ladder(a)
    out = save(a, res, wall_s=time.perf_counter() - t0)
    print("\n" + table(res))
    for peer in dict.fromkeys(r["peer"] for r in res):
        fit = [r for r in res if r["peer"] == peer and r["ok"]]
        best = max(fit, key=lambda r: r["params"]) if fit else None
        print(f"{peer}: largest that fits {best['params'] / 1e9:.2f} B (depth {best['depth']})" if best
              else f"{peer}: nothing on the ladder fits")  # fmt: skip
    print(f"wrote {a.json} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
