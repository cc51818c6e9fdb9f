"""`horizon train`: checks and set-up (run), the run dir's lock and resume point (rundir), which
settings may change on resume (compat), the loop (loop), checkpoints, metrics."""

from .run import run_training

__all__ = ["run_training"]
