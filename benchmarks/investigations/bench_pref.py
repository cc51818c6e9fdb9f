"""Preference optimisation on the streamed engine: a DPO (SimPO, ORPO) step against an SFT step on
the same tokens, and the reference pass's throughput.

    .venv/bin/python -m benchmarks.investigations.bench_pref --json bench_out/pref.json
    .venv/bin/python -m benchmarks.investigations.bench_pref --layers 4 --steps 4 --rounds 1      # a quick run

A random Llama (transformers' init, seed 0) is converted to a store; the same random token pairs
(prompt + chosen, prompt + rejected; labels on the completions) are trained by each mode in a
process of its own, `--rounds` times in turn (A B C A B C ...) so that load on a shared machine
falls on every mode alike:

    sft    the 2 x pairs sequences as SFT rows (TokenCE: one pass over the head), the same labels
    dpo    the pairs with the DPO loss (two passes over the head) and their reference log-probs,
           which the child first computes with the streamed forward-only pass (timed: the
           reference pass's throughput)
    simpo, orpo   reference-free (orpo: the NLL over the chosen rows' prompts too)

Per mode: the best and median step time after --warmup steps, the engine's device peak (its
accounting of device memory: on the CPU the plan's categories) and the process's peak RSS
(ru_maxrss, set-up included). Writes --json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("sft", "dpo", "simpo", "orpo")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--pairs", type=int, default=8, help="pairs per optimizer step (2x sequences)")
    ap.add_argument("--micro", type=int, default=4, help="pairs per micro-batch")
    ap.add_argument("--prompt", type=int, default=96, help="prompt tokens")
    ap.add_argument("--completion", type=int, default=160, help="tokens per completion")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--store", type=Path, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def build_store(a, work: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from horizon_cli.convert import convert

    cfg = LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=max(1, a.heads // 2), max_position_embeddings=4096,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(work / "hf")
    convert(work / "hf", work / "store", dtype=a.dtype)
    return work / "store"


def pairs(a, n: int):
    """n random pairs as rows (chosen, rejected, ...): prompt + completion, labels on the completion."""
    import numpy as np

    from horizon_cli.data.batch import IGNORE
    from horizon_cli.data.tokset import Row

    g = np.random.default_rng(1)
    rows = []
    for _ in range(n):
        prompt = g.integers(3, a.vocab, a.prompt, dtype=np.int32)
        for _side in range(2):
            comp = g.integers(3, a.vocab, a.completion, dtype=np.int32)
            ids = np.concatenate([prompt, comp])
            rows.append(Row(ids, np.concatenate([np.full(a.prompt, IGNORE, np.int32), comp])))
    return rows


def child(a) -> dict:
    import torch

    from horizon_cli.config.schema import EngineConfig, OptimConfig, PreferenceConfig
    from horizon_cli.data import collate
    from horizon_cli.data.pairs import collate_pairs
    from horizon_cli.engine import Engine
    from horizon_cli.recipes.preference.loss import PairObjective
    from horizon_cli.store import Store

    torch.set_num_threads(a.threads)
    mode = a.child
    obj = None if mode == "sft" else PairObjective(PreferenceConfig(loss=mode, beta=0.1))
    store = Store.open(a.store)
    tokens = 2 * a.pairs * (a.prompt + a.completion)
    eng = Engine(
        store,
        EngineConfig(device="cpu", dtype=a.dtype),
        OptimConfig(lr=1e-5),
        max_tokens=tokens,
        objective=obj,
    )
    out: dict = {"mode": mode}
    try:
        data = pairs(a, a.pairs)  # the same pairs every step (the first of the reference pass's)
        ref = None
        if mode == "dpo":
            every = pairs(a, a.pairs * 4)  # the reference pass over 4 steps' pairs, a step's pairs per sweep
            for rnd in ("cold", "warm"):  # cold: the first pass of a process (kernels built per shape)
                t0 = time.perf_counter()
                vals = []
                for k in range(0, len(every), 2 * a.pairs):
                    mbs = collate_pairs(every[k : k + 2 * a.pairs], a.micro, 0)
                    vals += eng.sequence_logps(mbs)
                dt = time.perf_counter() - t0
                out["reference" if rnd == "warm" else "reference_cold"] = {
                    "pairs": len(every) // 2, "s": dt, "pairs_per_s": len(every) / 2 / dt,
                    "tokens_per_s": sum(len(r.input_ids) for r in every) / dt, "sweeps": len(every) // (2 * a.pairs),
                }  # fmt: skip
            ref = torch.cat(vals[: a.pairs // a.micro]).reshape(-1, 2).numpy()
        times, peaks = [], []
        for s in range(a.steps):
            mbs = collate(data, 2 * a.micro, 0) if obj is None else collate_pairs(data, a.micro, 0, ref)
            t0 = time.perf_counter()
            res = eng.step(mbs, 1e-5, eng.objective.divisor(mbs))
            eng.wait()
            if s >= a.warmup:
                times.append(time.perf_counter() - t0)
            peaks.append(res.device_peak_bytes)
            out["weight_loads"] = res.weight_loads
        out.update(
            step_s_best=min(times), step_s_median=statistics.median(times), device_peak_bytes=max(peaks),
            tokens=tokens, tokens_per_s=tokens / min(times),
        )  # fmt: skip
    finally:
        eng.close()
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.child:
        print(json.dumps(child(a)))
        return
    modes = a.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        store = build_store(a, Path(tmp))
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(a.rounds):
            for m in modes:
                cmd = [sys.executable, __file__, "--child", m, "--store", str(store)] + (argv or sys.argv[1:])
                env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONPATH": str(ROOT)}
                r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                runs[m].append(json.loads(r.stdout.strip().splitlines()[-1]))
                print(f"{m}: {runs[m][-1]['step_s_best']:.2f} s", flush=True)
    result = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "modes": {}}
    for m, rs in runs.items():
        best = min(rs, key=lambda r: r["step_s_best"])
        result["modes"][m] = {**best, "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs), "rounds": rs}
    report(result)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")


def report(result: dict) -> None:
    m = result["modes"]
    base = m.get("sft")
    print(
        "\n| mode | best step (s) | median (s) | ÷ sft | device peak (MiB) | peak RSS (GiB) | weight loads |"
    )
    print("|---|---|---|---|---|---|---|")
    for k, r in m.items():
        ratio = f"{r['step_s_best'] / base['step_s_best']:.2f}" if base else "-"
        print(f"| {k} | {r['step_s_best']:.2f} | {r['step_s_median']:.2f} | {ratio} | "
              f"{r['device_peak_bytes'] / 2**20:.1f} | {r['peak_rss_bytes'] / 2**30:.2f} | {r['weight_loads']} |")  # fmt: skip
    if "dpo" in m:
        ref = m["dpo"]["reference"]
        step = m["dpo"]["step_s_best"]
        print(f"\nreference pass: {ref['pairs']} pairs in {ref['sweeps']} sweeps, {ref['s']:.2f} s: "
              f"{ref['pairs_per_s']:.1f} pairs/s, {ref['tokens_per_s']:,.0f} tokens/s "
              f"({ref['s'] / ref['sweeps'] / step:.2f} of a DPO step per sweep; the first, cold pass: "
              f"{m['dpo']['reference_cold']['s']:.2f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
