"""Sequence tiles on transformers' own layers (the generic path, arch.tiling: the MLP/MoE child
found by structure, each tile under activation checkpointing): peak memory of one layer's
forward + backward against the sequence, and the step-time cost of tiling (issue 30). Called by
benchmarks/investigations/bench_tile.py --generic FAMILY[,FAMILY...]:

    .venv/bin/python -m benchmarks.investigations.bench_tile --generic mistral,qwen3_moe,qwen3_next --peak --seqs 4096,8192,16384
    .venv/bin/python -m benchmarks.investigations.bench_tile --generic mistral,qwen3_moe,qwen3_next --time --seq 4096 --tile 1024

FAMILY: mistral (dense, a sliding window of 1,024 tokens, converted to the generic path), qwen3_moe
(8 experts, top 2), qwen3_next (a Gated DeltaNet layer with a MoE block: the scan stays whole, the
MoE is tiled). Every model is built with transformers' init (seed 0), saved and converted to an
fp32 store (convert path="generic").

--peak: a one-layer model, tiny but wide (hidden 128, 2 heads of 64, one K/V head, vocab 64;
intermediate 2048, or experts of 1024 with 2 active), one engine step (fp32, one thread, one row
of --seqs tokens, untiled and tiled by --tile), each in a process of its own: a warm-up step at
the same length (optimizer state, saved-input buffers, thread pools), then the step measured as
tests.support.layer_peak's engine_peak measures (glibc told to return freed blocks, the
kernel's peak resident set reset): what the step needs beyond what it holds between steps, i.e. one layer's
forward + recompute + backward, the embedding and the chunked loss (64 logits a token). Beside it
the plan's layer working set (planning.memory.layer_work_bytes).

--time: two engines on one store (hidden 512, 2 layers, vocab 8,192; intermediate 1,376, or 8
experts of 688 with 2 active; Qwen3-Next: a DeltaNet layer and an attention layer, each MoE), one
untiled, one with tiles of --tile tokens; one row of --seq tokens a step, steps alternating A B A B
after a warm-up step each; the median wall time and the median CPU time of the process.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def hf_config(family: str, wide: bool, seq: int) -> dict:
    """Peak (wide): 1 layer, hidden 128, intermediate 2048; time: 2 layers, hidden 512."""
    H, layers, vocab = (128, 1, 64) if wide else (512, 2, 8192)
    inter = 2048 if wide else 1376
    heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64) if wide else dict(
        num_attention_heads=8, num_key_value_heads=8, head_dim=64)  # fmt: skip
    base = dict(hidden_size=H, num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=seq,
                tie_word_embeddings=False, **heads)  # fmt: skip
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=inter // 2, norm_topk_prob=True)
    if family == "mistral":
        return dict(base, model_type="mistral", intermediate_size=inter, sliding_window=1024)
    if family == "qwen3_moe":
        return dict(base, model_type="qwen3_moe", intermediate_size=inter, decoder_sparse_step=1, **moe)
    if family == "qwen3_next":
        kinds = ["linear_attention"] if wide else ["linear_attention", "full_attention"]
        lin = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=64,
                   linear_value_head_dim=64, linear_conv_kernel_dim=4)  # fmt: skip
        return dict(base, model_type="qwen3_next", intermediate_size=inter, layer_types=kinds,
                    shared_expert_intermediate_size=inter // 2, full_attention_interval=2, **lin, **moe)  # fmt: skip
    raise SystemExit(f"--generic: {family} is not one of mistral, qwen3_moe, qwen3_next")


def build_store(family: str, wide: bool, seq: int, root: Path):
    import torch
    import transformers

    from horizon_cli.convert import convert
    from horizon_cli.store import Store

    hf = hf_config(family, wide, seq)
    cfg = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(root / "hf")
    convert(root / "hf", root / "store", dtype="float32", path="generic")
    return Store.open(root / "store")


def one_row(seq: int, vocab: int):
    import torch

    from horizon_cli.data.batch import MicroBatch

    ids = torch.randint(3, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    return MicroBatch(ids, ids.clone(), torch.arange(seq)[None].clone())


def engine(store, tile: int):
    from horizon_cli.config.schema import EngineConfig, OptimConfig
    from horizon_cli.engine import Engine

    ecfg = EngineConfig(device="cpu", dtype="float32", seq_tile=tile, keep_activations=0, compute_threads=1)
    return Engine(store, ecfg, OptimConfig(kernel="torch"))


def peak(families: list[str], seqs: list[int], tile: int) -> list[dict]:
    rows = []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for family in families:
        with tempfile.TemporaryDirectory() as tmp:
            store = build_store(family, True, max(seqs), Path(tmp))
            for seq in seqs:
                for t in (0, tile):
                    job = json.dumps({"store": str(store.root), "tokens": seq, "tile": t})
                    out = subprocess.run([sys.executable, "-m", "tests.support.layer_peak", job],
                                         capture_output=True, text=True, env=env, check=True)  # fmt: skip
                    r = {"family": family, "tokens": seq, **json.loads(out.stdout.strip().splitlines()[-1])}
                    rows.append(r)
                    what = f"tiles of {t}" if t else "untiled"
                    print(f"{family} {seq:>6} tokens, {what:>14}: measured {r['peak_bytes'] / 2**20:8.1f} MiB, "
                          f"plan {r['plan_bytes'] / 2**20:8.1f} MiB (+ weight grads "
                          f"{r['weight_grad_bytes'] / 2**20:.1f} MiB), {r['seconds']:.1f} s", flush=True)  # fmt: skip
    return rows


def step_time(families: list[str], seq: int, tile: int, rounds: int) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    rows = []
    for family in families:
        with tempfile.TemporaryDirectory() as tmp:
            store = build_store(family, False, seq, Path(tmp))
            mb = one_row(seq, store.arch.vocab)
            engines = {t: engine(store, t) for t in (0, tile)}
            wall: dict[int, list[float]] = {t: [] for t in engines}
            cpu: dict[int, list[float]] = {t: [] for t in engines}
            try:
                for r in range(rounds + 1):
                    for t, eng in engines.items():
                        c0, w0 = time.process_time(), time.perf_counter()
                        eng.step([mb], 1e-5)
                        eng.wait()
                        if r:  # the first step of each is a warm-up
                            wall[t].append(time.perf_counter() - w0)
                            cpu[t].append(time.process_time() - c0)
            finally:
                for eng in engines.values():
                    eng.close()
        got = {t: (statistics.median(wall[t]), statistics.median(cpu[t])) for t in engines}
        for t, (w, c) in got.items():
            row = {"family": family, "tile": t, "tokens": seq, "wall_s": w, "cpu_s": c,
                   "wall_vs_untiled": w / got[0][0], "cpu_vs_untiled": c / got[0][1]}  # fmt: skip
            rows.append(row)
            print(f"{family} tile {t}: step {w:.2f} s wall ({row['wall_vs_untiled']:.3f}), "
                  f"{c:.2f} s CPU ({row['cpu_vs_untiled']:.3f})", flush=True)  # fmt: skip
    return rows
