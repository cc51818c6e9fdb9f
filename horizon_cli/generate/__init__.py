"""`horizon generate` and what shares its engine: prompts (prompts), the source (source), sampling
and stopping (sample), the generation loop (loop), the plan shown before it starts (plan), the
command (run), and horizon's model for lm-evaluation-harness (harness)."""

from .run import Settings, run_generate

__all__ = ["Settings", "run_generate"]
