"""Tests of sharded runs under torchrun (horizon_cli/parallel/); dist_*.py are the scripts its ranks run."""
