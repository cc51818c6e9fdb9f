"""Throughput of horizon on a CUDA GPU at an 8B-class layer shape, with MFU and peak device memory
against the plan.

    python3 benchmarks/gpu_throughput.py [--json FILE] [--layers 4] [--batch 16] [--micro 4] [--seq 4096]
        [--steps 4] [--store DIR] [--profile-config FILE] [--keep 0|N|auto]

The model has Llama-3.1-8B's layers and vocabulary (hidden 4096, intermediate 14336, 32 query and
8 key/value heads, vocab 128256, untied) but only --layers of them, so its random store builds in
seconds; per-layer compute, the link and the loss head are those of the real 8B model. --store
keeps the store for a later `horizon profile` (--profile-config writes a config that profiles it).

Model FLOPs per token (MFU's numerator) count the matmuls of every layer and the LM head,
forward and backward (6 x those parameters), plus causal attention's score and value products
(3 x 2 x 2 x layers x q_dim x seq / 2) — every token here is real. Hardware FLOPs add the recompute
forward of every recomputed layer: horizon does that work, but it is not model progress (a kept
layer, --keep, skips it). Peak: the H200's dense bf16 datasheet figure (989 TFLOP/s).

--keep (engine.keep_activations, default 0): the last K layers keep their graph and weights from
forward to backward; auto: as many as the plan leaves room for on this GPU's free memory (what
`horizon train` would keep). The plan the peak is held against includes the kept layers.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.data.batch import MicroBatch
from horizon_cli.engine import Engine
from horizon_cli.planning.fit import Machine
from horizon_cli.planning.keep import keep_plan
from horizon_cli.planning.memory import memory_plan
from horizon_cli.store import Store, layouts
from tests.support.synthetic import random_store

PEAK = 989e12


def llama_8b_layers(n: int) -> dict:
    return dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=n,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )


def flops_per_token(spec, seq: int, kept: int = 0) -> tuple[float, float]:
    """(model, hardware) FLOPs per token for training, `kept` layers not recomputed."""
    lay = [x for x in layouts(spec) if x.name.startswith("layer.")]
    layer_params = sum(x.params for x in lay)
    head = spec.vocab * spec.hidden
    attn = 2 * 2 * spec.n_layers * spec.q_dim * seq / 2  # QK^T and AV per token, forward, causal
    model = 6 * (layer_params + head) + 3 * attn
    recomputed = (spec.n_layers - kept) / spec.n_layers
    hardware = model + recomputed * (2 * layer_params + attn)  # + the recompute forward of those layers
    return model, hardware


def profile_config(path: Path, store: Path, args) -> None:
    """A config for `horizon profile` of the same store and shapes (profile reads no data)."""
    data = path.with_suffix(".jsonl")
    data.write_text('{"text": "unused"}\n')
    path.write_text(
        f"# horizon profile {path}\n"
        f"model: {{path: {store}}}\n"
        f"data: {{path: {data.resolve()}, max_seq_len: {args.seq}}}\n"
        f"train: {{batch_size: {args.batch}, micro_batch_size: {args.micro}}}\n"
        "engine: {device: cuda, dtype: bfloat16, loss_chunk: 4096}\n"
        "optim: {lr: 1.0e-5}\n"
        f"output: {{dir: {path.parent.resolve() / 'profile-run'}}}\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--store", type=Path, help="build the store here (kept), or reuse it")
    ap.add_argument("--profile-config", type=Path)
    ap.add_argument("--keep", default="0", help="engine.keep_activations: 0, N or auto")
    args = ap.parse_args()
    keep_setting = args.keep if args.keep == "auto" else int(args.keep)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.store or Path(tmp) / "store"
        t0 = time.time()
        cfg = llama_8b_layers(args.layers)
        store = Store.open(root) if (root / "manifest.json").is_file() else random_store(root, cfg)
        print(
            f"store of {store.manifest.params / 1e9:.2f}B parameters in {time.time() - t0:.0f}s", flush=True
        )
        if args.profile_config:
            profile_config(args.profile_config, root.resolve(), args)
        ecfg = EngineConfig(device="cuda", dtype="bfloat16", loss_chunk=4096)
        plan = memory_plan(store.arch, "bfloat16", "auto", args.batch, args.micro, args.seq, 2, 4096)
        free, _ = torch.cuda.mem_get_info()
        plan = keep_plan(plan, keep_setting, Machine(1 << 50, free, "this GPU"))  # K as `train` picks it
        t0 = time.time()
        eng = Engine(store, ecfg, OptimConfig(lr=1e-5), max_tokens=args.batch * args.seq, keep=plan.kept)
        print(
            f"engine ready in {time.time() - t0:.0f}s (AdamW: {eng.optimizer.kernel_name}), "
            f"{plan.kept} of {args.layers} layers kept ({plan.kept_bytes / 2**30:.1f} GiB planned)",
            flush=True,
        )
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq), generator=g)
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
    model_f, hw_f = flops_per_token(store.arch, args.seq, plan.kept)
    peak = max(r.device_peak_bytes for r in results[1:])
    out = {
        "shape": "Llama-3.1-8B layers",
        "layers": args.layers,
        "params": store.manifest.params,
        "tokens_per_step": tokens,
        "step_s": step,
        "tokens_per_s": tokens / step,
        "model_tflops": model_f * tokens / step / 1e12,
        "hardware_tflops": hw_f * tokens / step / 1e12,
        "mfu": model_f * tokens / step / PEAK,
        "hfu": hw_f * tokens / step / PEAK,
        "device_peak_bytes": peak,
        "plan_device_bytes": plan.device_total,
        "peak_over_plan": peak / plan.device_total,
        "h2d_bytes": results[-1].h2d_bytes,
        "d2h_bytes": results[-1].d2h_bytes,
        "weight_loads": results[-1].weight_loads,
        "keep": args.keep,
        "kept_layers": plan.kept,
        "plan_kept_bytes": plan.kept_bytes,
        "steps": times,
        "gpu": torch.cuda.get_device_name(),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    assert math.isfinite(results[-1].loss)


if __name__ == "__main__":
    main()
