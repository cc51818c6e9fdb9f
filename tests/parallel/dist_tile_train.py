"""Test helper (tests/engine/test_seq_tile_dist.py): `horizon train` on each config given, as
tests/parallel/dist_train.py does (under torchrun every rank runs this), counting the token-local blocks
run tile by tile (model.tiling.tiles) and writing this rank's count to OUT/tiles<RANK>.json as
{config stem: count}, so the test knows every rank tiled.

    torchrun --nproc-per-node N tests/parallel/dist_tile_train.py OUT CFG...
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from rich.console import Console

from horizon_cli.model import tiling
from horizon_cli.parallel.launch import exit_rank
from horizon_cli.train import run_training

if __name__ == "__main__":
    out, cfgs = Path(sys.argv[1]), [Path(c) for c in sys.argv[2:]]
    count = [0]
    real = tiling.tiles

    def counted(*a, **k):
        count[0] += 1
        return real(*a, **k)

    tiling.tiles = counted  # type: ignore[assignment]
    counts = {}
    dist.init_process_group("gloo")
    try:
        for cfg in cfgs:
            before = count[0]
            run_training(cfg, [], console=Console(quiet=True))
            counts[cfg.stem] = count[0] - before
            dist.barrier()
    finally:
        dist.destroy_process_group()
    (out / f"tiles{os.environ['RANK']}.json").write_text(json.dumps(counts))
    exit_rank(0)  # as the CLI's ranks end (parallel.launch.exit_rank)
