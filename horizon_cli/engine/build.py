"""From a config to a planned, built engine: the one path every command that runs an engine takes
(`horizon train`, `horizon profile`, and the forward-only commands).

    plan_run      the config's run planned on its model: the rung it runs on and the ladder of every
                  rung (ladder), before anything is loaded
    check_fit     the plan against the device and the machine; refused in one line (exit 2)
    build_engine  the engine on a store (or a checkpoint's), its buffers sized from the config
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..arch import ArchSpec
from ..config import Config
from ..lora.setup import LoraSetup
from ..parallel.comm import Dist
from ..parallel.topology import World
from ..planning.fit import Machine, check_device_fit
from ..planning.ladder import PlannedModel, check_fits, fit_parts, not_applicable, plan_ladder, run_rung
from ..planning.memory import MemoryPlan
from ..planning.release import resolve_release
from ..runtime.trace import Tracer
from ..store import Store
from .dropout import model_dropout
from .engine import Engine
from .parts import Stage
from .seams import LossObjective


@dataclass
class Planned:
    """A config's run, planned: its model, adapters, world, rung and the ladder of every rung."""

    cfg: Config
    model: Store | PlannedModel
    lora: LoraSetup | None
    world: World
    rung: str
    rungs: dict[str, MemoryPlan]

    @property
    def plan(self) -> MemoryPlan:
        return self.rungs[self.rung]


def plan_run(
    cfg: Config,
    model: Store | PlannedModel,
    lora: LoraSetup | None,
    world: World = World(),
    where: Machine | None = None,
) -> Planned:
    """where: the machine `engine.keep_activations: auto` fits the kept layers to (None: none kept)."""
    rungs = plan_ladder(cfg, model, lora, world, where)
    return Planned(cfg, model, lora, world, run_rung(cfg, model), rungs)


def with_release(planned: Planned, where: Machine) -> tuple[Planned, str]:
    """The plan with optim.grad_release: auto resolved (planning.release): its config records
    true or false, its rung is the release rung where release went on; and the line saying why."""
    cfg, rung, line = resolve_release(
        planned.cfg, planned.rungs, planned.rung, where, lambda p, w: fit_parts(p, w)[0]
    )
    return replace(planned, cfg=cfg, rung=rung), line


def check_fit(planned: Planned, where: Machine) -> None:
    """The device first (lower the micro-batch, not the rung), then host and device on the machine."""
    check_device_fit(planned.plan, planned.cfg.engine)
    check_fits(planned.rungs, planned.rung, where, not_applicable(planned.model))


def step_tokens(cfg: Config, store: Store, world: int = 1) -> int:
    """The most tokens one rank's step holds (it sizes the buffers for saved inputs once)."""
    seqs = cfg.step_sequences  # a method's sequences per example (two a pair, G completions a prompt)
    return seqs * min(cfg.data.max_seq_len, store.arch.max_positions) // world


def build_engine(
    cfg: Config,
    store: Store,
    *,
    lora: LoraSetup | None = None,
    dist: Dist | None = None,
    tracer: Tracer | None = None,
    progress: Callable[[int], None] = lambda n: None,
    objective: LossObjective | None = None,
    keep: int = 0,
    stage: Stage | None = None,
) -> Engine:
    """The engine for `cfg` on `store` (a resumed full fine-tuning run: its checkpoint's store).
    keep: the kept layers K (the plan's decision: `Planned.plan.kept`)."""
    if cfg.engine.compute_threads:
        torch.set_num_threads(cfg.engine.compute_threads)
    world = dist.world if dist is not None else 1
    return Engine(
        store,
        cfg.engine,
        cfg.optim,
        tracer=tracer,
        progress=progress,
        max_tokens=step_tokens(cfg, store, world),
        lora=lora,
        dist=dist,
        objective=objective,
        keep=keep,
        dropout_seed=dropout_seed(cfg),
        stage=stage,
    )


def dropout_seed(cfg: Config) -> int | None:
    """The seed of the run's dropout masks (engine.dropout): train.seed, or None (off) when
    `model.dropout: 0` turns the model's dropout and router noise off, and when the run's method
    trains without it (config.Config.dropout_off)."""
    return None if cfg.model.dropout == 0 or cfg.dropout_off else cfg.train.seed


def dropout_line(cfg: Config, arch: ArchSpec) -> str | None:
    """What the run does with its model's dropout (the dry run's line), None: the model has none."""
    keys = model_dropout(arch)
    if not keys:
        return None
    said = ", ".join(f"{k} {v:g}" for k, v in keys)
    if cfg.model.dropout == 0:
        return f"dropout: off (model.dropout: 0; the model's config sets {said})"
    if cfg.dropout_off:
        return f"dropout: off in {cfg.dropout_off}; the config sets {said}"
    return f"dropout: on as the model's config sets it ({said}), masks seeded by train.seed; model.dropout: 0 turns it off"
