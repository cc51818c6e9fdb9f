"""`horizon train`: the loop (loop), run set-up and checks (run), checkpoints, metrics."""

from .run import run_training

__all__ = ["run_training"]
