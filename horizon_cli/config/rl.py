"""The `rl:` section's cross-field checks (online RL, rl/): what it trains on and its rewards.

Single values are checked by the schema's metadata (num_generations >= 2, beta >= 0, loss_type
and scale_rewards among TRL 1.16's names). Here: at least one reward; a reward names a built-in,
a "file.py:name" or a "module:name"
(whether it is there is the start's check, rl.rewards: a file is relative to the working directory),
or is a reward model (`model:` a store, alone); each built-in's own keys given, and only those; no
`preference:` section beside it; prompts only, not packed.
"""

from __future__ import annotations

from .schema import BUILTIN_REWARDS, Config

NEEDS = {"format": ("pattern",), "length": ("target",)}
ONLY = {"pattern": "format", "target": "length", "column": "accuracy"}
_MODEL_NOT = ("function", "pattern", "target", "tolerance", "column")


def rl_problems(cfg: Config) -> list[str]:
    rl = cfg.rl
    if rl is None:
        return ["data.format: prompt-only data is trained online: add an rl: section"] * (
            cfg.data.format == "prompt"
        )
    p = []
    if cfg.preference is not None:
        p.append("rl: online RL and a preference: section do not go together; remove one")
    if cfg.data.format not in ("auto", "prompt"):
        p.append(f"data.format: rl trains on prompts (format prompt or auto), not {cfg.data.format}")
    if cfg.data.packing:
        p.append("data.packing: rl's completions are not packed; set it false")
    if not rl.rewards:
        p.append("rl.rewards: give at least one reward function (e.g. [{function: accuracy}])")
    for i, r in enumerate(rl.rewards):
        key = f"rl.rewards[{i}]"
        if r.model is not None:  # a reward model's store (recipes.grpo.reward_model: checked at the start)
            p += [
                f"{key}.{k}: a reward model takes none (it has model:)" for k in _MODEL_NOT if getattr(r, k)
            ]
            continue
        p += _function_problems(key, r.function)
        for need in NEEDS.get(r.function, ()):
            if getattr(r, need) is None:
                p.append(f"{key}.{need}: the built-in {r.function} reward needs it")
        for k, fn in ONLY.items():
            if getattr(r, k) is not None and r.function != fn:
                p.append(f"{key}.{k}: only the built-in {fn} reward uses it, not {r.function!r}")
        if r.tolerance and r.function != "length":
            p.append(f"{key}.tolerance: only the built-in length reward uses it, not {r.function!r}")
    if isinstance(cfg.data.path, list) and len(cfg.data.path) > 1:
        p.append("data.path: rl reads one source of prompts for now (give one path)")
    return p + _sampling_problems(rl) + _engine_problems(cfg)


def _engine_problems(cfg: Config) -> list[str]:
    """rl.rollout_engine / rollout_weights against the run (recipes/grpo/rollout_engine.py; the
    sizes are the start's and the dry run's to judge)."""
    rl = cfg.rl
    assert rl is not None
    if rl.rollout_engine == "streamed" and rl.rollout_weights not in ("auto", "full"):
        return [
            f"rl.rollout_weights: {rl.rollout_weights} is a resident copy's format; the streamed engine "
            "decodes from the trained weights (set rollout_engine: resident or auto)"
        ]
    if rl.rollout_engine != "resident":
        return []
    if cfg.lora is not None:
        weights = "" if rl.rollout_weights in ("auto", "full") else " with rl.rollout_weights auto or full"
        return [
            "rl.rollout_engine: resident: a LoRA run's rollouts stream its frozen base and adapters; set "
            f"streamed or auto{weights}"
        ]
    if cfg.engine.kv_cache == "host":
        return [
            "rl.rollout_engine: resident decodes with its KV cache on the device, not engine.kv_cache: host; "
            "set kv_cache auto or device, or rollout_engine streamed"
        ]
    return []


def _sampling_problems(rl) -> list[str]:
    """The importance-sampling combinations TRL 1.16 refuses (GRPOConfig.__post_init__, and
    GRPOTrainer.__init__ for vespo)."""
    lo, hi, mode = (
        rl.importance_sampling_clip_min,
        rl.importance_sampling_clip_max,
        rl.importance_sampling_mode,
    )
    if lo is not None and hi is not None and lo >= hi:
        return [
            f"rl.importance_sampling_clip_min: {lo} must be less than importance_sampling_clip_max ({hi})"
        ]
    if not rl.importance_sampling_correction:
        return []
    if mode.endswith("truncate") and lo is None and hi is None:
        return [f"rl.importance_sampling_mode: {mode} needs importance_sampling_clip_min or _clip_max set"]
    if rl.loss_type == "vespo" and mode.startswith("sequence"):
        return [
            f"rl.importance_sampling_mode: vespo needs token_truncate or token_mask, not {mode} "
            "(or importance_sampling_correction: false)"
        ]
    return []


def _function_problems(key: str, fn: str) -> list[str]:
    if fn in BUILTIN_REWARDS:
        return []
    mod, sep, name = fn.rpartition(":")
    if not sep or not mod or not name:
        return [
            f"{key}.function: {fn!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor "
            '"file.py:name" or "module:name"'
        ]
    return []  # whether the file or module is there: rl.rewards, at the start (it reads the cwd)
