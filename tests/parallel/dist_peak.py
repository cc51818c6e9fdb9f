"""Test helper (tests/parallel/test_dist.py): under torchrun, one optimizer step of the engine per case given
in CASES (a JSON list), each on this rank's share of a global batch of full-length rows, and the
engine's reported device peak written to OUT/rank<R>.json as {case name: bytes}, and the step's loss
to OUT/rank<R>.loss.json as {case name: loss}.

    torchrun --nproc-per-node N tests/parallel/dist_peak.py CASES OUT
"""

import json
import sys
from pathlib import Path

import torch

from horizon_cli.config.schema import EngineConfig, LoraConfig, OptimConfig
from horizon_cli.data.batch import MicroBatch
from horizon_cli.engine import Engine
from horizon_cli.lora.setup import lora_setup
from horizon_cli.parallel.comm import Dist
from horizon_cli.parallel.launch import exit_rank, joined
from horizon_cli.store import Store


def peak(case: dict, d: Dist) -> tuple[int, float]:
    store = Store.open(case["store"])
    cfg = EngineConfig(**case["engine"])
    lora = lora_setup(LoraConfig(**case["lora"]), store.arch) if case["lora"] else None
    batch, micro, seq = case["batch"], case["micro"], case["seq"]
    eng = Engine(
        store,
        cfg,
        OptimConfig(kernel="torch", memory=case.get("memory", "exact")),
        max_tokens=batch * seq // d.world,
        lora=lora,
        dist=d,
    )
    try:
        g = torch.Generator().manual_seed(0)
        rows = [torch.randint(0, store.arch.vocab, (seq,), generator=g).tolist() for _ in range(batch)]
        mbs = [MicroBatch.from_rows([(r, r) for r in rows[i : i + micro]], 0) for i in range(0, batch, micro)]
        k = len(mbs) // d.world
        res = eng.step(mbs[d.rank * k : (d.rank + 1) * k], 1e-3, sum(mb.label_tokens for mb in mbs))
        eng.wait()
        return res.device_peak_bytes, res.loss
    finally:
        eng.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    cases, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    with joined("cpu") as d:
        assert d is not None, "run under torchrun with several ranks"
        got = {c["name"]: peak(c, d) for c in cases}
    (out / f"rank{d.rank}.json").write_text(json.dumps({k: v[0] for k, v in got.items()}))
    (out / f"rank{d.rank}.loss.json").write_text(json.dumps({k: v[1] for k, v in got.items()}))
    exit_rank(0)  # as the CLI's ranks end (parallel.launch.exit_rank)
