"""Generation speed: decode tokens/s against batch size on the CPU with an emulated link, against the
link-bound model; prefill tokens/s; and the plan's figures for large models on one H200 over PCIe.

    .venv/bin/python -m benchmarks.investigations.bench_generate                 # measure (CPU, emulated link) + paper plans
    .venv/bin/python -m benchmarks.investigations.bench_generate --plan-only     # the paper plans alone
    .venv/bin/python -m benchmarks.investigations.bench_generate --json bench_out/generate.json

Measured: a random-weight Llama-shaped store (tests/support/synthetic.py), fp32 (generation computes in
fp32 on the CPU, whose bf16 matrix products are slow at few rows), `engine.link_gbps` set
so that one sweep of the weights takes SWEEP_MS on the link; for each batch size, greedy decoding
of NEW tokens after prompts of PROMPT tokens through generate.decoder's loop (the one `horizon
generate` runs). Link bound: batch x link / bytes per sweep (generate/budget.py). A decode step
is also bounded by the CPU's compute (2 FLOPs per parameter per token), which the last column
estimates from the batch-1 step's compute.

On paper: generate.budget.plan_generation for Llama-3.1-70B and Mistral-Large-2407 on one H200
(141 GB, 139 GiB usable) with 55 GB/s of PCIe 5 per direction (docs/benchmarks.md's assumption),
bf16 and NF4 stores, prompts of 1024 tokens + 512 new.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from horizon_cli.arch import spec_from_hf
from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.generate.budget import plan_generation, weights_per_sweep
from horizon_cli.generate.decoder import Decoder, SweepStats
from horizon_cli.generate.kvcache import kv_bytes
from horizon_cli.generate.kvprobe import per_layer
from horizon_cli.model.sample import Sampler
from horizon_cli.model.template import make_template

ROOT = Path(__file__).resolve().parents[2]

MODEL = dict(model_type="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, vocab_size=8192, max_position_embeddings=4096,
             rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip
BATCHES = (1, 4, 16, 64)
PROMPT, NEW = 64, 16
SWEEP_MS = 1000.0  # the emulated link moves one sweep's weights in this long (--sweep-ms)

PAPER = {
    "Llama-3.1-70B": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=131072, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "Mistral-Large-2407": json.loads((ROOT / "tests" / "fixtures" / "mistral-large-2407.config.json").read_text()),
}  # fmt: skip
H200 = 139 * 2**30  # usable device bytes
PCIE = 55.0  # GB/s, PCIe 5 x16, effective, per direction
PAPER_BATCHES = (1, 16, 64, 256)
PAPER_PROMPT, PAPER_NEW = 1024, 512


def run_batch(store, b: int, link: float) -> tuple[list[SweepStats], float]:
    g = torch.Generator().manual_seed(b)
    eng = Engine(store, EngineConfig(device="cpu", dtype="float32", link_gbps=link), OptimConfig(),
                 forward_only=True)  # fmt: skip
    sweeps: list[SweepStats] = []
    dec = Decoder(eng, Sampler(), max_new_tokens=NEW, on_sweep=sweeps.append)
    prompts = [(i, torch.randint(3, MODEL["vocab_size"], (PROMPT,), generator=g).tolist()) for i in range(b)]
    t0 = time.perf_counter()
    dec.run(prompts)
    wall = time.perf_counter() - t0
    eng.close()
    return sweeps, wall


def decode_step_s(sweeps: list[SweepStats]) -> float:
    dec = [s for s in sweeps if not s.prefill][1:]  # the first decode sweep warms up
    return sum(s.seconds for s in dec) / len(dec)


def measure(store, link: float) -> list[dict]:
    """Per batch: decode steps with no link (the CPU's compute alone: the loader lends host memory)
    and with the emulated link; prefill speed from the linked run."""
    rows = []
    for b in BATCHES:
        compute = decode_step_s(run_batch(store, b, 0.0)[0])
        sweeps, wall = run_batch(store, b, link)
        pre = [s for s in sweeps if s.prefill]
        step = decode_step_s(sweeps)
        dec = [s for s in sweeps if not s.prefill][1:]
        rows.append({"batch": b, "prefill_tokens_per_s": sum(s.tokens for s in pre) / sum(s.seconds for s in pre),
                     "compute_step_s": compute, "decode_step_s": step, "decode_tokens_per_s": b / step,
                     "h2d_bytes_per_step": sum(s.h2d_bytes for s in dec) / len(dec), "wall_s": wall})  # fmt: skip
    return rows


def paper() -> list[dict]:
    out = []
    for name, cfg in PAPER.items():
        spec = spec_from_hf(cfg)
        sizes = per_layer(make_template(spec, torch.device("cpu")))
        for quant in ("", "nf4"):
            for b in PAPER_BATCHES:
                S = PAPER_PROMPT + PAPER_NEW
                micro = max(1, 8192 // PAPER_PROMPT)  # generate.decoder.MICRO_TOKENS
                batches = [(min(micro, b - a), PAPER_PROMPT, S) for a in range(0, b, micro)]
                kv = kv_bytes([(n, s) for n, _, s in batches], sizes, 2)
                p = plan_generation(
                    spec, "bfloat16", batches, kv, quant=quant, link_gbps=PCIE, device_free=H200
                )
                flops = 2 * spec_params(spec) * b  # one decode step's compute
                out.append({"model": name, "store": quant or "bf16", "batch": b, "sweep_gb": p.sweep_bytes / 1e9,
                            "kv_gb": kv / 1e9, "kv_where": p.kv_where, "device_gib": p.device_total / 2**30,
                            "step_s": p.sweep_s, "bound_tokens_per_s": p.bound_tokens_per_s,
                            "compute_s_at_700tflops": flops / 700e12})  # fmt: skip
    return out


def spec_params(spec) -> int:
    from horizon_cli.store import layouts

    return sum(lay.params for lay in layouts(spec))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--sweep-ms", type=float, default=SWEEP_MS, help="the link's time for one sweep's weights"
    )
    args = ap.parse_args()
    result: dict = {"paper": paper()}
    print("plan: one H200 (139 GiB), PCIe 55 GB/s, prompts 1024 + 512 new tokens")
    print(f"{'model':20s} {'store':5s} {'batch':>5s} {'sweep GB':>9s} {'KV GB':>7s} {'KV on':>6s} "
          f"{'device GiB':>10s} {'step s':>7s} {'tok/s bound':>11s} {'compute s':>9s}")  # fmt: skip
    for r in result["paper"]:
        print(f"{r['model']:20s} {r['store']:5s} {r['batch']:5d} {r['sweep_gb']:9.1f} {r['kv_gb']:7.1f} "
              f"{r['kv_where']:>6s} {r['device_gib']:10.1f} {r['step_s']:7.2f} {r['bound_tokens_per_s']:11.1f} "
              f"{r['compute_s_at_700tflops']:9.3f}")  # fmt: skip
    if not args.plan_only:
        from tests.support.synthetic import random_store

        torch.set_num_threads(2)
        with tempfile.TemporaryDirectory() as tmp:
            store = random_store(Path(tmp) / "store", MODEL, dtype="float32")
            spec = store.arch
            sweep = weights_per_sweep(spec, "float32")
            link = sweep / (args.sweep_ms / 1e3) / 1e9
            rows = measure(store, link)
        result["measured"] = {"model": MODEL, "sweep_bytes": sweep, "link_gbps": link, "rows": rows}
        print(f"\nmeasured: CPU, {sweep / 1e6:.1f} MB per sweep, link emulated at {link:.3f} GB/s "
              f"({args.sweep_ms:g} ms per sweep), prompts {PROMPT} + {NEW} new tokens")  # fmt: skip
        print(f"{'batch':>5s} {'prefill tok/s':>13s} {'compute s':>9s} {'step s':>7s} {'decode tok/s':>12s} "
              f"{'link bound':>10s} {'model':>8s}")  # fmt: skip
        for r in rows:
            bound = r["batch"] / (args.sweep_ms / 1e3)
            model = r["batch"] / max(
                args.sweep_ms / 1e3, r["compute_step_s"]
            )  # the slower of link and compute
            r.update(link_bound_tokens_per_s=bound, model_tokens_per_s=model)
            print(f"{r['batch']:5d} {r['prefill_tokens_per_s']:13.0f} {r['compute_step_s']:9.3f} "
                  f"{r['decode_step_s']:7.3f} {r['decode_tokens_per_s']:12.1f} {bound:10.1f} {model:8.1f}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
