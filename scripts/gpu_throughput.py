"""Throughput of horizon on a CUDA GPU: a ~1.2B-parameter Llama-shaped random model at seq 2048.

    python3 scripts/gpu_throughput.py [--json FILE] [--steps N] [--batch B] [--micro M]

Model FLOPs per token (MFU's numerator) count the matmuls of every layer and the LM head,
forward and backward (6 x those parameters), plus causal attention's score and value products
(6 x 2 x layers x hidden x seq, halved for causality) — padding excluded (every token here is
real). Hardware FLOPs add the recompute forward of every layer (2 x layer parameters + its
attention): horizon does that work, but it is not model progress. Peak: the H200's dense bf16
datasheet figure (989 TFLOP/s); the measured matmul ceiling here was ~790 (device/KINDS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from synthetic import random_store

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.data.batch import MicroBatch
from horizon_cli.engine.schedule import Engine
from horizon_cli.store import layouts

LLAMA_1B = dict(
    model_type="llama",
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
PEAK = 989e12


def flops_per_token(spec, seq: int) -> tuple[float, float]:
    """(model, hardware) FLOPs per token for training."""
    lay = [x for x in layouts(spec) if x.name.startswith("layer.")]
    layer_params = sum(x.params for x in lay)
    head = spec.vocab * spec.hidden
    attn = 2 * 2 * spec.n_layers * spec.q_dim * seq / 2  # QK^T and AV per token, forward, causal
    model = 6 * (layer_params + head) + 3 * attn
    hardware = model + 2 * layer_params + attn  # + the recompute forward of every layer
    return model, hardware


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        store = random_store(Path(tmp) / "store", LLAMA_1B)
        print(
            f"store of {store.manifest.params / 1e9:.2f}B parameters in {time.time() - t0:.0f}s", flush=True
        )
        eng = Engine(
            store,
            EngineConfig(device="cuda", dtype="bfloat16", loss_chunk=4096),
            OptimConfig(lr=1e-5),
            max_tokens=args.batch * args.seq,
        )
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, LLAMA_1B["vocab_size"], (args.batch, args.seq), generator=g)
        pos = torch.arange(args.seq).expand(args.batch, args.seq)
        mbs = [
            MicroBatch(ids[i : i + args.micro], ids[i : i + args.micro], pos[i : i + args.micro])
            for i in range(0, args.batch, args.micro)
        ]
        times, results = [], []
        for s in range(args.steps + 1):
            t = time.perf_counter()
            results.append(eng.step(mbs, 1e-5))
            times.append(time.perf_counter() - t)
            print(f"step {s}: {times[-1]:.3f}s loss {results[-1].loss:.4f}", flush=True)
        eng.wait()
        eng.close()
    step = sorted(times[1:])[len(times[1:]) // 2]
    tokens = args.batch * args.seq
    model_f, hw_f = flops_per_token(store.arch, args.seq)
    out = {
        "params": store.manifest.params,
        "tokens_per_step": tokens,
        "step_s": step,
        "tokens_per_s": tokens / step,
        "model_tflops": model_f * tokens / step / 1e12,
        "hardware_tflops": hw_f * tokens / step / 1e12,
        "mfu": model_f * tokens / step / PEAK,
        "hfu": hw_f * tokens / step / PEAK,
        "device_peak_bytes": results[-1].device_peak_bytes,
        "h2d_bytes": results[-1].h2d_bytes,
        "d2h_bytes": results[-1].d2h_bytes,
        "weight_loads": results[-1].weight_loads,
        "steps": times,
        "gpu": torch.cuda.get_device_name(),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    assert math.isfinite(results[-1].loss)


if __name__ == "__main__":
    main()
