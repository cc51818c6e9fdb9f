"""`horizon generate`: the source (store or run dir: source), the plan shown before it starts
(plan), the command (run), and horizon's model for lm-evaluation-harness (harness). The prompts
(data.prompts), sampling (model.sample) and the generation loop (engine.generate) live below, where
eval-time samples (train.loop) use them too."""

from .run import Settings, run_generate

__all__ = ["Settings", "run_generate"]
