"""Llama through the native functional layer and through the generic path (transformers' own
LlamaDecoderLayer bound to the streamed views), same store contents, same schedule (issue 11).

    .venv/bin/python -m benchmarks.investigations.bench_generic [--json FILE] [--repeats N] [--dtype bfloat16|float32]

A Llama-shaped model (8 layers, hidden 512, GQA) is built with random weights, saved, and converted
twice (`convert(path="native")` and `convert(path="generic")`). Both engines run on `device: cpu`;
after one warm-up step each, steps alternate native / generic `--repeats` times (the machine may
be shared: interleaving exposes both to the same load) and the best step of each is reported,
with the ratio generic / native. Both runs compute the same losses (printed, to show they agree).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import transformers

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.convert import convert
from horizon_cli.data.batch import MicroBatch
from horizon_cli.engine import Engine
from horizon_cli.store import Store

MODEL = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=4096,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
BATCH, MICRO, SEQ = 8, 4, 256


def build(tmp: Path) -> dict[str, Store]:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL))
    model.save_pretrained(tmp / "hf")
    stores = {}
    for path in ("native", "generic"):
        convert(tmp / "hf", tmp / path, dtype="float32", path=path)
        stores[path] = Store.open(tmp / path)
    return stores


def batches() -> list[MicroBatch]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(MICRO, SEQ)
    return [MicroBatch(ids[i : i + MICRO], ids[i : i + MICRO].clone(), pos) for i in range(0, BATCH, MICRO)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args()
    mbs = batches()
    with tempfile.TemporaryDirectory(prefix="horizon-bench-generic-") as tmp:
        stores = build(Path(tmp))
        engines = {
            k: Engine(s, EngineConfig(device="cpu", dtype=args.dtype), OptimConfig(lr=1e-5))
            for k, s in stores.items()
        }
        times: dict[str, list[float]] = {k: [] for k in engines}
        losses: dict[str, list[float]] = {k: [] for k in engines}
        try:
            for k, eng in engines.items():  # warm-up: first-step kernel compilation
                losses[k].append(eng.step(mbs, 1e-5).loss)
                eng.wait()
            for _ in range(args.repeats):
                for k, eng in engines.items():
                    t0 = time.perf_counter()
                    losses[k].append(eng.step(mbs, 1e-5).loss)
                    eng.wait()
                    times[k].append(time.perf_counter() - t0)
        finally:
            for eng in engines.values():
                eng.close()
    best = {k: min(v) for k, v in times.items()}
    out = {
        "model": {**MODEL, "batch": BATCH, "micro_batch": MICRO, "seq": SEQ, "dtype": args.dtype},
        "threads": torch.get_num_threads(),
        "step_s": times,
        "best_step_s": best,
        "generic_over_native": best["generic"] / best["native"],
        "losses": losses,
    }
    print(
        f"best step: native {best['native']:.3f} s, generic {best['generic']:.3f} s, "
        f"generic / native = {out['generic_over_native']:.3f} ({args.repeats} interleaved repeats, {args.dtype})"
    )
    print("losses native :", " ".join(f"{x:.5f}" for x in losses["native"]))
    print("losses generic:", " ".join(f"{x:.5f}" for x in losses["generic"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
