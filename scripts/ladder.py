"""The largest dense model each memory rung fits on a machine, by the memory plan.

    .venv/bin/python scripts/ladder.py                       # one H200 (141 GiB) + 1,500 GiB of RAM
    .venv/bin/python scripts/ladder.py --host-gib 1500 --device-gib 141 --config configs/mistral-large-123b-sft.yaml

For each width (a released model's hidden size, heads, KV heads, MLP and vocabulary), the depth is
grown until the plan of `--config`'s run (batch, sequence length, micro-batch, prefetch) no longer
fits the machine, per rung (train.run.plan_ladder, the figures `horizon train --dry-run` prints;
no layer kept). Then what Llama-3.1-405B itself (126 layers) needs on each rung, and the host bytes
per parameter of released models on the full rungs, without and with gradient release (the
gradient's share: the release chunks, and the embedding's fp32 gradient: docs/memory.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from horizon_cli.arch import spec_from_hf
from horizon_cli.config import load_config
from horizon_cli.fmt import fmt_bytes
from horizon_cli.planning.host_state import compact_rows
from horizon_cli.planning.ladder import fit_parts, plan_for
from horizon_cli.planning.memory import RUNGS
from horizon_cli.preflight import given_machine
from horizon_cli.store import layouts

ROOT = Path(__file__).resolve().parents[1]
LLAMA_405B = "Llama-3.1-405B width (h 16384)"
WIDTHS = {  # model_type mistral/llama, as config.json has them
    "Mistral-Large-2407 width (h 12288)": dict(model_type="mistral", hidden_size=12288, intermediate_size=28672,
                                               num_attention_heads=96, num_key_value_heads=8, vocab_size=32768),
    LLAMA_405B: dict(model_type="llama", hidden_size=16384, intermediate_size=53248,
                                           num_attention_heads=128, num_key_value_heads=8, vocab_size=128256),
}  # fmt: skip
FIXTURES = ROOT / "tests" / "fixtures"  # released models' config.json files
LLAMA_70B = dict(WIDTHS[LLAMA_405B], hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                 num_hidden_layers=80, tie_word_embeddings=False)  # fmt: skip
MODELS = {
    "Llama-3.1-70B": LLAMA_70B,
    "gpt-oss-120b": "gpt-oss-120b",
    "Mistral-Large-2407": "mistral-large-2407",
    "Qwen3-235B-A22B": "qwen3-235b-a22b",
    "Llama-3.1-405B": dict(WIDTHS[LLAMA_405B], num_hidden_layers=126, tie_word_embeddings=False),
    "Gemma-3-27B": "gemma-3-27b",
}


def bytes_per_param(cfg, name: str, model: dict | str) -> str:
    """A docs/memory.md row: the release chunks' and the embedding gradient's B/param, then exact /
    exact+release and lean / lean+release."""
    hf = model if isinstance(model, dict) else json.loads((FIXTURES / f"{model}.config.json").read_text())
    spec = spec_from_hf(dict(hf, max_position_embeddings=hf.get("max_position_embeddings", 131072)))
    plans = {rung: plan_for(cfg, spec, rung) for rung in ("exact", "exact+release", "lean", "lean+release")}
    params = plans["exact"].params
    tokens = cfg.step_sequences * cfg.data.max_seq_len
    embed = (
        compact_rows(spec, {lay.name: lay for lay in layouts(spec)}, tokens, 1) or spec.vocab * spec.hidden
    )
    grads = next(v for k, v in plans["exact+release"].host.items() if k.startswith("gradients"))
    tied = ", tied" if spec.tie_embeddings else ""
    b = {rung: f"{p.bytes_per_param:.2f}" for rung, p in plans.items()}
    return (
        f"| {name} ({params / 1e9:.1f}B){tied} | {(grads - embed * 4) / params:.3f} | {embed * 4 / params:.3f} | "
        f"{b['exact']} / {b['exact+release']} | {b['lean']} / {b['lean+release']} |"
    )


def largest(cfg, width: dict, rung: str, machine, max_layers: int = 4000) -> tuple[int, int]:
    """(layers, parameters) of the deepest model of this width whose `rung` plan fits."""
    lo, hi = 0, max_layers  # fits at lo (0: nothing), not at hi
    params = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        spec = spec_from_hf(
            dict(width, num_hidden_layers=mid, max_position_embeddings=131072, rms_norm_eps=1e-5)
        )
        plan = plan_for(cfg, spec, rung)
        if fit_parts(plan, machine)[0]:
            lo, params = mid, plan.params
        else:
            hi = mid
    return lo, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host-gib", type=float, default=1500.0, help="RAM, GiB")
    ap.add_argument("--device-gib", type=float, default=141.0, help="CUDA device memory, GiB")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "mistral-large-123b-sft.yaml")
    args = ap.parse_args()
    cfg = load_config(args.config)
    machine = given_machine(args.host_gib, args.device_gib)
    t = cfg.train
    print(f"machine: {args.host_gib:g} GiB RAM, {args.device_gib:g} GiB CUDA device; run: batch {t.batch_size} x "
          f"{cfg.data.max_seq_len}, micro-batch {t.micro_batch_size} ({args.config.name})\n")  # fmt: skip
    print("| width | " + " | ".join(RUNGS) + " |\n|---|" + "---|" * len(RUNGS))
    for name, width in WIDTHS.items():
        cells = []
        for rung in RUNGS:
            layers, params = largest(cfg, width, rung, machine)
            cells.append(f"{params / 1e9:.0f}B ({layers} layers)" if layers else "none")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nLlama-3.1-405B (126 layers): host need (B/param), fits\n")
    spec = spec_from_hf(dict(WIDTHS[LLAMA_405B], num_hidden_layers=126, max_position_embeddings=131072))
    for rung in RUNGS:
        plan = plan_for(cfg, spec, rung)
        fit = "fits" if fit_parts(plan, machine)[0] else "no"
        print(f"- {rung}: {fmt_bytes(plan.node_host_total)} ({plan.bytes_per_param:.2f} B/param), {fit}")
    print("\nhost B/param of released models (the release chunks, the embedding's gradient, the rungs)\n")
    print("| model | the 3 chunks | embedding (fp32) | exact / exact+release | lean / lean+release |")
    print("|---|---:|---:|---:|---:|")
    for name, model in MODELS.items():
        print(bytes_per_param(cfg, name, model))


if __name__ == "__main__":
    main()
