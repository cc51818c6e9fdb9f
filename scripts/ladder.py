"""The largest dense model each memory rung fits on a machine, by the memory plan.

    .venv/bin/python scripts/ladder.py                       # one H200 (141 GiB) + 1,500 GiB of RAM
    .venv/bin/python scripts/ladder.py --host-gib 1500 --device-gib 141 --config configs/mistral-large-123b-sft.yaml

For each width (a released model's hidden size, heads, KV heads, MLP and vocabulary), the depth is
grown until the plan of `--config`'s run (batch, sequence length, micro-batch, prefetch) no longer
fits the machine, per rung (train.run.plan_ladder, the figures `horizon train --dry-run` prints;
no layer kept). Then what Llama-3.1-405B itself (126 layers) needs on each rung.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from horizon_cli.arch import spec_from_hf
from horizon_cli.config import load_config
from horizon_cli.fmt import fmt_bytes
from horizon_cli.planning.ladder import fit_parts, plan_for
from horizon_cli.planning.memory import RUNGS
from horizon_cli.preflight import given_machine

ROOT = Path(__file__).resolve().parents[1]
LLAMA_405B = "Llama-3.1-405B width (h 16384)"
WIDTHS = {  # model_type mistral/llama, as config.json has them
    "Mistral-Large-2407 width (h 12288)": dict(model_type="mistral", hidden_size=12288, intermediate_size=28672,
                                               num_attention_heads=96, num_key_value_heads=8, vocab_size=32768),
    LLAMA_405B: dict(model_type="llama", hidden_size=16384, intermediate_size=53248,
                                           num_attention_heads=128, num_key_value_heads=8, vocab_size=128256),
}  # fmt: skip


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


if __name__ == "__main__":
    main()
