"""optim.grad_release: `auto` resolved against the ladder, and what a release run does to clipping.

`auto` is decided once, before the engine is built (train.run, after the plan of every rung on the
machine): release goes on exactly when the run's rung does not fit without it and its release rung
(`exact+release`, `lean+release`) does; otherwise it stays off. A LoRA run's adapters have small
gradients, so `auto` leaves it off; `true` composes with LoRA (its plan is the lora rung's: the
adapters' gradients are counted whole, an upper bound). The resolved value is what the run's
config records (config.yaml), and one line says why.

Release and clipping (the engine's semantics, docs/engine.md): with `optim.grad_clip: 0` one pass,
the same training bit for bit as without release; with `grad_clip > 0` a norm-first pass (as
built, engine/step.py released_step: a whole forward and backward that only measure the global
norm, then the releasing forward and backward): each recomputed layer loaded 4 times a step
instead of 2, each kept layer twice instead of once, and twice the compute (`norm_first_loads`).
A non-finite gradient found mid-release stops the run, its last checkpoint intact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..config import Config
from ..fmt import fmt_bytes
from ..optim.modes import RUNG_MODES
from .fit import Machine
from .memory import MemoryPlan

Fit = Callable[[MemoryPlan, Machine], bool]


def resolve_release(
    cfg: Config, rungs: dict[str, MemoryPlan], rung: str, where: Machine, fit: Fit
) -> tuple[Config, str, str]:
    """(the config with optim.grad_release: auto resolved to true or false, the rung the run then
    runs on, the line saying why; "" where the config named it). fit: whether a plan fits a
    machine (planning.ladder's fit_parts, which sits above this module)."""
    if cfg.optim.grad_release != "auto":
        return cfg, rung, ""
    on, why = False, "a lora: run's adapters have small gradients"
    mode = RUNG_MODES.get(rung)
    if mode is not None:
        rel = mode.released().name
        on, why = decide(rungs[rung], rungs[rel], rung, rel, where, fit)
        rung = rel if on else rung
    word = "true" if on else "false"
    cfg = replace(cfg, optim=replace(cfg.optim, grad_release=word))
    return cfg, rung, f"optim.grad_release: auto -> {word}: {why}"


def decide(
    base: MemoryPlan, rel: MemoryPlan, name: str, rel_name: str, where: Machine, fit: Fit
) -> tuple[bool, str]:
    """Release on exactly when the base rung's plan does not fit and the release rung's does; why."""
    if fit(base, where):
        return False, f"{name} fits without it"
    if not fit(rel, where):
        return False, f"{name} does not fit with it either"
    freed = base.node_host_total - rel.node_host_total
    return True, (
        f"{name} does not fit {where.what} without it (host {fmt_bytes(base.node_host_total)}), "
        f"{rel_name} does ({rel.bytes_per_param:.2f} B/param, {fmt_bytes(freed)} less host)"
    )


def clipping_line(cfg: Config, plan: MemoryPlan) -> str:
    """What a release run does to clipping, in one line (the dry run's); "" without release."""
    if cfg.optim.grad_release != "true":
        return ""
    if cfg.lora is not None and cfg.optim.grad_clip == 0:
        return (
            "gradient release on a lora: run: the adapters' updates run inside the backward; their "
            "gradients are small, so the plan hardly changes"
        )
    if cfg.lora is not None:
        return (
            f"gradient release on a lora: run with optim.grad_clip {cfg.optim.grad_clip:g} > 0: one pass, "
            "the adapters updated after the backward once the global norm is known, as without "
            "release (their gradients are small and kept whole; a norm-first pass would double the "
            "step for nothing)"
        )
    if cfg.optim.grad_clip == 0:
        return (
            "gradient release, optim.grad_clip 0: one pass, each unit's AdamW inside the backward; "
            "the same training bit for bit as without release; a non-finite gradient stops the run "
            "(the last checkpoint intact)"
        )
    recomputed = (plan.calls or plan.layers) - plan.kept
    loads, base = norm_first_loads(recomputed, plan.kept), 2 * recomputed + plan.kept
    return (
        f"gradient release, optim.grad_clip {cfg.optim.grad_clip:g} > 0: a norm-first pass: a whole "
        f"forward and backward that only measure the global norm, then the releasing forward and "
        f"backward: {loads} layer loads a step instead of {base} (each recomputed layer 4 times "
        f"instead of 2, each kept layer twice instead of once; {recomputed} recomputed, {plan.kept} "
        f"kept here) and twice the compute; optim.grad_clip: 0 runs one pass"
    )


def step_passes(cfg: Config) -> int:
    """The forward and backward passes a training step of `cfg` runs (optim.modes.passes)."""
    return cfg.optim.mode.passes(cfg.optim.grad_clip, cfg.lora is not None)


def norm_first_loads(recomputed: int, kept: int) -> int:
    """Layer weight loads of a norm-first release step (grad_clip > 0): two whole passes, each
    loading a recomputed layer twice (forward, backward) and a kept layer once."""
    return 2 * (2 * recomputed + kept)
