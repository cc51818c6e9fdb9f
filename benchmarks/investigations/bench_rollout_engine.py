"""Rollout seconds, resident against streamed (issue 40), on the CPU with an emulated link: the
same batch of GRPO rollouts sampled by recipes.grpo.rollout_engine.Rollouts (what a GRPO step
calls) on a forward-only engine with `engine.link_gbps` set, once streamed (every layer over the
link in each decode sweep) and once from a resident copy in each format (the model over the link
once, at the refresh). Every row runs the whole length (no EOS). Reports wall seconds (the
refresh included), the refresh's seconds and bytes and the link bytes of the decode sweeps. The
cases run interleaved (every link and engine once, then again, `--repeats` times: the machine is
shared) and the table gives each case's median wall seconds, every sample in `--json`. The narrowed
copies' log-prob gap to the full weights is not measured here (tests do that).

    .venv/bin/python -m benchmarks.investigations.bench_rollout_engine --json bench_out/rollout-engine.json

A random Llama (transformers' init, seed 0, fp32; benchmarks.investigations.bench_grpo.build) is
saved and converted to an fp32 store.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.investigations.bench_grpo import build


def save(a: argparse.Namespace, rows: dict) -> None:
    """Every sample so far to --json (none: nothing written)."""
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        rows_out = [x for rs in rows.values() for x in rs]
        a.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows_out}, indent=1)
        )


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="completion tokens")
    ap.add_argument("--links", default="0.2,0.4,0.8", help="emulated link GB/s")
    ap.add_argument("--formats", default="full,int8,fp8,nf4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def one(store: Path, a, link: float, engine: str, fmt: str, prompts: list[list[int]]) -> dict:
    from horizon_cli.config.schema import EngineConfig, OptimConfig, RLConfig
    from horizon_cli.engine import Engine
    from horizon_cli.recipes.grpo.rollout_engine import Rollouts
    from horizon_cli.store import Store

    eng = Engine(Store.open(store), EngineConfig(device="cpu", dtype="float32", link_gbps=link), OptimConfig(),
                 forward_only=True)  # fmt: skip
    rl = RLConfig(
        num_generations=a.G, max_completion_length=a.new, rollout_engine=engine, rollout_weights=fmt
    )
    roll = Rollouts(rl, eng, False, "auto", len(prompts) * a.G, a.prompt)
    stats: list = []
    try:
        t0 = time.perf_counter()
        out = roll.sample(prompts, a.G, 7, None, eos=[], tokenizer=None, on_sweep=stats.append)
        wall = time.perf_counter() - t0
    finally:
        eng.close()
    assert all(len(r.ids) == a.new for r in out), "every row runs the whole length"
    dec = [s for s in stats if not s.prefill]
    return {"link_gbps": link, "engine": engine, "weights": fmt, "wall_s": wall, "refresh_s": roll.refresh_s,
            "refresh_bytes": roll.refresh_bytes, "decode_h2d_bytes": sum(s.h2d_bytes for s in dec),
            "sweeps": len(dec), "tokens_per_s": len(out) * a.new / wall}  # fmt: skip


def main(argv=None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    work = Path(tempfile.mkdtemp(prefix="bench-rollout-engine-"))
    _, store = build(a, work)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, a.vocab, (a.prompt,), generator=g).tolist() for _ in range(a.prompts)]
    one(store, a, 0.0, "streamed", "full", prompts)  # warm-up, not kept
    cases = [("streamed", "full"), *(("resident", f) for f in a.formats.split(","))]
    links = [float(x) for x in a.links.split(",")]
    rows: dict[tuple[float, str, str], list[dict]] = {}
    for _ in range(a.repeats):
        for link in links:
            for engine, fmt in cases:
                r = one(store, a, link, engine, fmt, prompts)
                rows.setdefault((link, engine, fmt), []).append(r)
                print(
                    f"sample: link {link:g} {engine} {fmt}: {r['wall_s']:.2f} s (refresh {r['refresh_s']:.2f} s)",
                    flush=True,
                )
                save(a, rows)  # every sample so far: a long run interrupted keeps what it measured
    print(
        "| link GB/s | engine | weights | rollout s (median) | samples | refresh s | refresh MiB | decode sweeps' link MiB | tokens/s |"
    )
    print("|---:|---|---|---:|---|---:|---:|---:|---:|", flush=True)
    for rs in rows.values():
        r, wall = rs[0], statistics.median(x["wall_s"] for x in rs)
        ref = statistics.median(x["refresh_s"] for x in rs)
        samples = " ".join(f"{x['wall_s']:.2f}" for x in rs)
        print(f"| {r['link_gbps']:g} | {r['engine']} | {r['weights']} | {wall:.2f} | {samples} | {ref:.2f} | "
              f"{r['refresh_bytes'] / 2**20:.1f} | {r['decode_h2d_bytes'] / 2**20:.1f} | {len(prompts) * a.G * a.new / wall:,.0f} |",
              flush=True)  # fmt: skip
    save(a, rows)


if __name__ == "__main__":
    main()
