"""The layer working set the plan reserves for each hybrid family at its default sizes, with and
without the recurrent mixers measured at convert (docs/benchmarks.md).

    python -m benchmarks.investigations.plan_workset
"""

from __future__ import annotations

from dataclasses import replace

from transformers import AutoConfig

from horizon_cli.arch.spec import spec_from_hf
from horizon_cli.planning.memory import layer_work_bytes

TYPES = ("qwen3_next", "qwen3_5_moe_text", "jamba", "falcon_h1", "nemotron_h", "bamba")


def main(rows: int = 1, T: int = 4096) -> None:
    print("| model type | hidden | table estimate (GiB) | with the measured mixer (GiB) |")
    print("|---|---|---|---|")
    for mt in TYPES:
        spec = spec_from_hf(AutoConfig.for_model(mt).to_dict(), path="generic")
        new = layer_work_bytes(spec, rows * T, rows, T, 2)
        assert spec.generic is not None
        old_spec = replace(spec, generic=replace(spec.generic, workset={}))  # no mixer measured
        old = layer_work_bytes(old_spec, rows * T, rows, T, 2)
        print(f"| `{mt}` | {spec.hidden} | {old / 2**30:.2f} | {new / 2**30:.2f} |")


if __name__ == "__main__":
    main()
