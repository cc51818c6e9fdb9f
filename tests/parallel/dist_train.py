"""Test helper: `horizon train` on each config given, in turn, in one process (under torchrun:
every rank runs this), so a test pays the start-up of a rank once for several runs. One process
group serves them all (re-creating the default group in one process can meet stale rendezvous
keys), and a barrier ends each run, because rank 0 finishes a run after the others."""

import sys
from pathlib import Path

import torch.distributed as dist
from rich.console import Console

from horizon_cli.parallel.launch import exit_rank
from horizon_cli.train import run_training

if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        for cfg in sys.argv[1:]:
            run_training(Path(cfg), [], console=Console(quiet=True))
            dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank(0)  # as the CLI's ranks end (parallel.launch.exit_rank)
