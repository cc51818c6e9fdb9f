"""Online RL (issue 29): rollout tokens/s against batch from the streamed engine with an emulated
link, against resident transformers `generate`; the split of a GRPO step (rollout / reference /
train); a GRPO step against an SFT step on the same tokens.

    .venv/bin/python -m benchmarks.investigations.bench_grpo --json bench_out/grpo.json
    .venv/bin/python -m benchmarks.investigations.bench_grpo --batches 1,4 --steps 2 --rounds 1     # a quick run

A random Llama (transformers' init, seed 0, fp32) is saved and converted to an fp32 store.

rollouts   for each batch size b: b random prompts of --prompt tokens, one completion each of
           exactly --new tokens (no EOS: every row runs the whole length), sampled at temperature 1
           by rl.rollouts.sample (the function a GRPO step calls: generate.decoder's loop) on a
           forward-only engine with `engine.link_gbps` set so that one sweep of the weights takes
           --sweep-ms on the link, and again with no link (the CPU's compute alone); against the
           same checkpoint resident in transformers, `generate(do_sample=True, top_k=0)` with
           min_new_tokens = max_new_tokens = --new. Tokens/s = b x new / wall (prefill included),
           and horizon's decode sweeps alone (prefill left out, as the progress line shows it).
step       `horizon train` with an `rl:` section in a child process: --prompts prompts x G
           completions of up to --new tokens, beta --beta (the streamed reference pass), the
           built-in length reward, the link emulated; metrics.jsonl's rollout_s, reference_s,
           engine_s (the training step) and step_s. Then `horizon train` SFT on the same tokens:
           the rollouts files' prompt + completion rows, labels on the completions, one step's
           rollouts a step, the same micro-batches and link. Runs alternate (grpo sft grpo sft
           ...) for --rounds so that load on a shared machine falls on both alike; the first
           step of each run is left out (kernels for new shapes), the best of the rest is kept.

Writes --json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batches", default="1,4,16", help="rollout batch sizes (sequences)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="completion tokens")
    ap.add_argument("--sweep-ms", type=float, default=20.0, help="the emulated link's time for one sweep")
    ap.add_argument("--prompts", type=int, default=2, help="prompts a GRPO step")
    ap.add_argument("--G", type=int, default=8, help="num_generations")
    ap.add_argument("--micro", type=int, default=8, help="completions (SFT: rows) per micro-batch")
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="rollout timings per batch (best kept)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: rollouts,step")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def build(a, work: Path) -> tuple[Path, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from horizon_cli.convert import convert

    cfg = LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=max(1, a.heads // 2), max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(work / "hf")
    convert(work / "hf", work / "store", dtype="float32")
    return work / "hf", work / "store"


def link_for(store_path: Path, sweep_ms: float) -> tuple[float, int]:
    from horizon_cli.generate.budget import weights_per_sweep
    from horizon_cli.store import Store

    store = Store.open(store_path)
    sweep = weights_per_sweep(store.arch, "float32", "")
    return sweep / (sweep_ms / 1000) / 1e9, sweep


def horizon_rollout(store_path: Path, prompts: list[list[int]], new: int, link: float) -> dict:
    from horizon_cli.config.schema import EngineConfig, OptimConfig
    from horizon_cli.engine import Engine
    from horizon_cli.recipes.grpo.rollouts import sample, speed
    from horizon_cli.store import Store

    eng = Engine(Store.open(store_path), EngineConfig(device="cpu", dtype="float32", link_gbps=link), OptimConfig(),
                 forward_only=True)  # fmt: skip
    rl = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_completion_length=new)
    stats: list = []
    try:
        t0 = time.perf_counter()
        out = sample(eng, prompts, 1, rl, 7, [], None, "device", on_sweep=stats.append)
        wall = time.perf_counter() - t0
    finally:
        eng.close()
    assert all(len(r.ids) == new for r in out), "every row runs the whole length"
    dec = [s for s in stats if not s.prefill]
    return {"wall_s": wall, "tokens_per_s": len(prompts) * new / wall, "decode_tokens_per_s": speed(stats),
            "sweep_s": sum(s.seconds for s in dec) / len(dec), "h2d_bytes_per_sweep": sum(s.h2d_bytes for s in dec) / len(dec)}  # fmt: skip


def hf_rollout(model, prompts: list[list[int]], new: int) -> dict:
    ids = torch.tensor(prompts)
    torch.manual_seed(7)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
        )  # fmt: skip
    wall = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new
    return {"wall_s": wall, "tokens_per_s": len(prompts) * new / wall}


def rollouts(a, hf: Path, store: Path) -> dict:
    from transformers import AutoModelForCausalLM

    link, sweep = link_for(store, a.sweep_ms)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    warm = [torch.randint(3, a.vocab, (a.prompt,)).tolist()]
    horizon_rollout(store, warm, a.new, link), hf_rollout(model, warm, a.new)  # warm-up, not timed
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        g = torch.Generator().manual_seed(b)
        prompts = [torch.randint(3, a.vocab, (a.prompt,), generator=g).tolist() for _ in range(b)]
        runs: dict[str, list[dict]] = {"horizon_link": [], "horizon_nolink": [], "transformers": []}
        for _ in range(a.repeat):  # interleaved, best kept
            runs["horizon_link"].append(horizon_rollout(store, prompts, a.new, link))
            runs["horizon_nolink"].append(horizon_rollout(store, prompts, a.new, 0.0))
            runs["transformers"].append(hf_rollout(model, prompts, a.new))
        best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in runs.items()}
        rows.append({"batch": b, **best, "runs": runs})
        print(f"rollouts b={b}: " + ", ".join(f"{k} {v['tokens_per_s']:.0f} tok/s" for k, v in best.items())
              + f"; linked sweep {best['horizon_link']['sweep_s'] * 1000:.0f} ms, "
              f"{best['horizon_link']['h2d_bytes_per_sweep'] / 2**20:.1f} MiB", flush=True)  # fmt: skip
    return {
        "link_gbps": link,
        "sweep_bytes": sweep,
        "bound_tokens_per_s_per_row": 1000 / a.sweep_ms,
        "rows": rows,
    }


def write_cfg(run: Path, store: Path, source: Path, a, batch: int, engine: dict, **sections) -> Path:
    cfg = {
        "model": {"path": str(store)},
        "data": {"path": str(source), "max_seq_len": a.prompt + a.new, "shuffle": False},
        "train": {"steps": a.steps, "batch_size": batch, "micro_batch_size": a.micro, "seed": 0},
        "optim": {"lr": 1e-5, "weight_decay": 0.0, "grad_clip": 1.0},
        "schedule": {"kind": "constant", "warmup_steps": 0},
        "engine": {"device": "cpu", "dtype": "float32", **engine},
        "output": {"dir": str(run), "export": False, "save_every": 0},
        "log": {"every": 1, "plot": False},
        **sections,
    }
    path = run.parent / f"{run.name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def train(cfg: Path, run: Path, threads: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "horizon_cli", "train", str(cfg)]
    subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def steps(a, store: Path, work: Path) -> dict:
    link, _ = link_for(store, a.sweep_ms)
    g = torch.Generator().manual_seed(3)
    n = a.prompts * a.steps
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"prompt_input_ids": torch.randint(3, a.vocab, (a.prompt,), generator=g).tolist()}) + "\n"
        for _ in range(n)))  # fmt: skip
    rl = {"loss_type": "dapo", "num_generations": a.G, "max_completion_length": a.new, "beta": a.beta,
          "rewards": [{"function": "length", "target": a.new // 2, "tolerance": a.new // 8}]}  # fmt: skip
    engine = {"link_gbps": link}
    out: dict[str, list] = {"grpo": [], "sft": []}
    for r in range(a.rounds):
        run = work / f"grpo{r}"
        cfg = write_cfg(run, store, prompts, a, a.prompts, engine, rl=rl)
        m = train(cfg, run, a.threads)
        out["grpo"].append(m)
        print(f"grpo round {r}: " + " ".join(f"{x['step_s']:.2f}" for x in m) + " s/step", flush=True)
        sft_rows = work / f"sft{r}.jsonl"
        lines = []
        for s in range(1, a.steps + 1):
            for x in map(json.loads, (run / "rollouts" / f"step-{s}.jsonl").read_text().splitlines()):
                p, c = x["prompt_ids"], x["completion_ids"]
                lines.append(json.dumps({"input_ids": p + c, "labels": [-100] * len(p) + c}) + "\n")
        sft_rows.write_text("".join(lines))
        srun = work / f"sft{r}"
        cfg = write_cfg(srun, store, sft_rows, a, a.prompts * a.G, engine, data={
            "path": str(sft_rows), "format": "tokens", "max_seq_len": a.prompt + a.new, "shuffle": False,
            "packing": False})  # fmt: skip
        m = train(cfg, srun, a.threads)
        out["sft"].append(m)
        print(f"sft round {r}: " + " ".join(f"{x['step_s']:.2f}" for x in m) + " s/step", flush=True)
    return summarize(out)


def summarize(out: dict) -> dict:
    res: dict = {"raw": out}
    for mode, runs in out.items():
        rows = [x for m in runs for x in m[1:]]  # the first step of a run left out
        best = min(rows, key=lambda x: x["step_s"])
        keys = (
            "step_s",
            "engine_s",
            "rollout_s",
            "reference_s",
            "rollout_tokens_per_s",
            "tokens",
            "input_tokens",
        )
        res[mode] = {k: best[k] for k in keys if k in best}
        res[mode]["engine_s_best"] = min(x["engine_s"] for x in rows)
    return res


def report(result: dict) -> None:
    if "rollouts" in result:
        r = result["rollouts"]
        print(f"\nrollouts: link {r['link_gbps']:.3f} GB/s ({r['sweep_bytes'] / 2**20:.1f} MiB a sweep), "
              f"link bound {r['bound_tokens_per_s_per_row']:.0f} tokens/s per row")  # fmt: skip
        print("| batch | horizon, link (tok/s) | its decode sweeps | horizon, no link | transformers generate | "
              "link ÷ transformers |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for x in r["rows"]:
            h, n, t = x["horizon_link"], x["horizon_nolink"], x["transformers"]
            print(f"| {x['batch']} | {h['tokens_per_s']:.0f} | {h['decode_tokens_per_s']:.0f} | "
                  f"{n['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | {h['tokens_per_s'] / t['tokens_per_s']:.2f} |")  # fmt: skip
    if "steps" in result:
        g, s = result["steps"]["grpo"], result["steps"]["sft"]
        print(
            "\n| mode | step (s) | rollout | reference | train (engine) | train ÷ sft's | completion tokens |"
        )
        print("|---|---|---|---|---|---|---|")
        for k, x in (("grpo", g), ("sft", s)):
            print(f"| {k} | {x['step_s']:.2f} | {x.get('rollout_s', 0):.2f} | {x.get('reference_s', 0):.2f} | "
                  f"{x['engine_s']:.2f} | {x['engine_s_best'] / s['engine_s_best']:.2f} | {x['tokens']} |")  # fmt: skip


def main(argv=None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    skip = set(a.skip.split(",")) - {""}
    result: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        hf, store = build(a, Path(tmp))
        if "rollouts" not in skip:
            result["rollouts"] = rollouts(a, hf, store)
        if "step" not in skip:
            result["steps"] = steps(a, store, Path(tmp))
    report(result)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
