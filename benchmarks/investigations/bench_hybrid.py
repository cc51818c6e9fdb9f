"""Qwen3-Next (Gated DeltaNet + full attention, MoE) through horizon's generic path against
transformers' own model trained resident, on the CPU (issue 19).

    .venv/bin/python -m benchmarks.investigations.bench_hybrid [--json FILE] [--repeats N] [--dtype float32|bfloat16]
                                             [--keep auto|N] [--batch B --micro M --seq T]

A small random Qwen3NextForCausalLM (MODEL below: its layer_types mix linear_attention and
full_attention, every layer a sparse MoE block with a shared expert) is saved and converted to an
fp32 horizon store (path auto: the generic path). On the same batches (one sequence a row: packing
is refused for recurrent layers) two trainers step in turn:
  horizon  Engine.step on `device: cpu` (--keep: engine.keep_activations; auto keeps every layer's
           graph on the CPU, 0 recomputes every layer in backward as checkpointing does)
  hf       the transformers model from the same checkpoint, resident, gradient checkpointing on,
           torch.optim.AdamW(fused=True); bf16: fp32 master + bf16 autocast (what HF Trainer's
           bf16=True does; horizon's bf16 is fp32 master + bf16 compute too)
same lr / betas / eps / weight decay / clip, loss = summed CE / the global batch's label tokens.
One warm-up step each (step 1: its losses are compared), then `--repeats` interleaved steps; best
and median of each and the ratio horizon / hf. Prints the 1-minute load average before the runs
and after each repeat (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import transformers

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.convert import convert
from horizon_cli.data.batch import MicroBatch
from horizon_cli.engine import Engine
from horizon_cli.store import Store

MODEL = dict(
    hidden_size=256,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    intermediate_size=512,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    vocab_size=4096,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
BATCH, MICRO, SEQ = 4, 2, 128
OPTIM = dict(lr=1e-4, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0, grad_clip=1.0)


def batches(batch: int, micro: int, seq: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (batch, seq), generator=g)
    return [ids[i : i + micro] for i in range(0, batch, micro)]


class Hf:
    """transformers' own model, resident, as benchmarks/hf_peer.py trains it."""

    def __init__(self, hf_dir: Path, dtype: str):
        self.model = transformers.Qwen3NextForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        self.model.config.use_cache = False
        self.model.gradient_checkpointing_enable()
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        o = OPTIM
        self.opt = torch.optim.AdamW(
            self.params,
            lr=o["lr"],
            betas=tuple(o["betas"]),
            eps=o["eps"],
            weight_decay=o["weight_decay"],
            fused=True,
        )
        self.bf16 = dtype == "bfloat16"

    def step(self, mbs: list[torch.Tensor]) -> float:
        n = sum(int(m[:, 1:].numel()) for m in mbs)
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for ids in mbs:
            with torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else nullcontext():
                loss = self.model(input_ids=ids, labels=ids, num_items_in_batch=n).loss
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.params, OPTIM["grad_clip"])
        self.opt.step()
        return total


class Horizon:
    def __init__(self, store: Store, dtype: str, keep: int | str):
        cfg = EngineConfig(device="cpu", dtype=dtype, keep_activations=keep)
        self.eng = Engine(store, cfg, OptimConfig(**OPTIM))
        self.mbs = None

    def step(self, mbs: list[torch.Tensor]) -> float:
        if self.mbs is None:
            self.mbs = [MicroBatch(m, m.clone(), torch.arange(m.shape[1]).expand(m.shape)) for m in mbs]
        loss = self.eng.step(self.mbs, OPTIM["lr"]).loss
        self.eng.wait()
        return loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--keep", default="auto", help="engine.keep_activations: auto or a layer count")
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--micro", type=int, default=MICRO)
    ap.add_argument("--seq", type=int, default=SEQ)
    args = ap.parse_args()
    keep = args.keep if args.keep == "auto" else int(args.keep)
    mbs = batches(args.batch, args.micro, args.seq)
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="horizon-bench-hybrid-") as tmp:
        torch.manual_seed(0)
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**MODEL))
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(Path(tmp) / "hf")
        del model
        convert(Path(tmp) / "hf", Path(tmp) / "store", dtype="float32")
        store = Store.open(Path(tmp) / "store")
        runs = {"horizon": Horizon(store, args.dtype, keep), "hf": Hf(Path(tmp) / "hf", args.dtype)}
        times: dict[str, list[float]] = {k: [] for k in runs}
        losses: dict[str, list[float]] = {k: [] for k in runs}
        try:
            for k, r in runs.items():  # warm-up, step 1: the losses compared
                losses[k].append(r.step(mbs))
            for _ in range(args.repeats):
                for k, r in runs.items():
                    t0 = time.perf_counter()
                    losses[k].append(r.step(mbs))
                    times[k].append(time.perf_counter() - t0)
                load.append(os.getloadavg())
        finally:
            runs["horizon"].eng.close()
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "model": {
            **MODEL,
            "params": params,
            "batch": args.batch,
            "micro_batch": args.micro,
            "seq": args.seq,
            "dtype": args.dtype,
            "keep": keep,
        },
        "optim": OPTIM,
        "threads": torch.get_num_threads(),
        "load_avg_1_5_15": load,
        "step_s": times,
        "best_step_s": best,
        "median_step_s": med,
        "horizon_over_hf_best": best["horizon"] / best["hf"],
        "horizon_over_hf_median": med["horizon"] / med["hf"],
        "losses": losses,
        "step1_abs_diff": abs(losses["horizon"][0] - losses["hf"][0]),
    }
    print(
        f"params {params:,}; {args.dtype}; keep {keep}; {args.repeats} interleaved repeats; threads {out['threads']}"
    )
    for k in runs:
        print(
            f"{k:8s} best {best[k]:.3f} s  median {med[k]:.3f} s  steps {' '.join(f'{t:.2f}' for t in times[k])}"
        )
    print(f"horizon / hf: best {out['horizon_over_hf_best']:.3f}, median {out['horizon_over_hf_median']:.3f}")
    print("losses horizon:", " ".join(f"{x:.6f}" for x in losses["horizon"]))
    print("losses hf     :", " ".join(f"{x:.6f}" for x in losses["hf"]))
    print(
        f"step 1 |Δloss| {out['step1_abs_diff']:.2e}; load average (1 min) {' '.join(f'{x[0]:.2f}' for x in load)}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
