"""`horizon train`: config -> checks -> run dir (lock, resume) -> data -> engine -> loop -> export.

Everything that can be checked before training is checked first, so that bad input exits 2
before anything is written: the config, the store, the device, the memory plan, the run dir and
whether this config may resume it, the data (the order: train/checks.py). `--dry-run` runs the
same checks, writes nothing but its --json, and exits 2 with the start's line where it would stop.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

from .. import preflight
from ..arch.exceptions import refuse_packing
from ..config import Config, load_config
from ..data.prepare import check_lengths
from ..engine.build import plan_run, with_release
from ..engine.tuning import tuning_for
from ..errors import InputError
from ..faults import phase
from ..lora.setup import lora_for
from ..parallel.launch import joined, rank_device, world_from_env
from ..parallel.topology import world_for
from ..planning.ladder import open_model
from ..planning.release import clipping_line
from ..recipes.registry import recipe_for
from ..runtime.dtype import with_dtype
from ..store import DTYPES, Store
from ..vision.adapters import projector_targets
from ..vision.plan import add_to_plan, describe
from . import checks
from .claim import claim
from .length import resolve_length
from .loop import Trainer
from .report import dry_run_report
from .samples import Samples
from .signals import runtime_failures, stop_signals


def run_training(
    config_path: Path | None,
    overrides: list[str],
    dry_run: bool = False,
    console: Console | None = None,
    json_out: Path | None = None,
    machine: tuple[float, float] | None = None,
    ranks: tuple[int | None, int | None] = (None, None),
    base: dict | None = None,
) -> dict:
    """config_path: the YAML file (None: the config is `base`, a mapping of the same tree).
    machine: (host GiB, device GiB) of another machine to plan for (dry run only); ranks:
    (--world-size, --nproc-per-node) to plan for (dry run only; else torchrun's environment)."""
    console = console or Console()
    phase("startup")
    cfg, dtype = with_dtype(load_config(config_path, overrides, base=base))  # engine.dtype: auto decided
    if not dry_run:  # the cli refuses these flags without --dry-run
        assert machine is None and ranks == (None, None)
    world = world_for(*ranks)
    check_split(cfg, world.size)
    preflight.check_output_file(json_out, "--json")
    model = open_model(cfg.model.path, fetch=dry_run)  # a hub id: its config.json, dry runs only
    if not dry_run and not isinstance(model, Store):
        raise InputError(
            f"model.path: {model.root} is an HF checkpoint, not a store: convert it first "
            f"(horizon convert {model.root} STORE); --dry-run plans it as it is"
        )
    # checked before any write; a resume needs no lora.init (it has its checkpoint)
    adapted = projector_targets(model.arch, cfg.train.vision, cfg.lora.dropout) if cfg.lora else None
    lora = lora_for(cfg.lora, model, cfg.train.seed, run_dir=Path(cfg.output.dir), tower=adapted)
    note = tuning_for(lora).note
    for line in (note, dtype.note):
        if line and os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 speaks
            console.print(f"[yellow]warning:[/] {escape(line)}", highlight=False)
    check_lengths(cfg.data, model.arch.max_positions)
    refuse_packing(cfg.data.packing, model.arch)
    cfg = resolve_length(cfg, model, console, dry_run)  # train.epochs -> train.steps (reads the data)
    samples = Samples(cfg, model, world.size) if cfg.train.samples else None  # prompts checked now
    if machine is not None:
        where = preflight.given_machine(*machine)
    else:  # a real start under torchrun: this rank's own device (a dry run reports rank 0's)
        where = preflight.local_machine(cfg if dry_run else rank_cfg(cfg))
    planned = plan_run(cfg, model, lora, world, where)  # with the kept layers auto fits to `where`
    tower = add_to_plan(
        planned, model, DTYPES.get(cfg.engine.dtype, torch.bfloat16)
    )  # a vision tower's bytes
    if tower is not None and os.environ.get("RANK", "0") == "0":
        console.print(describe(tower, cfg), highlight=False)
    planned, release = with_release(planned, where)  # optim.grad_release: auto decided on the plan
    cfg = planned.cfg
    if dry_run:
        if os.environ.get("RANK", "0") != "0":  # under torchrun rank 0 reports for every rank
            console, json_out = Console(quiet=True), None
        return dry_run_report(
            planned, where, console, json_out, local=machine is None, dtype=dtype, release=release
        )
    assert isinstance(model, Store)
    if cfg.optim.grad_release == "true" and os.environ.get("RANK", "0") == "0":
        if release:
            console.print(escape(release), highlight=False)  # auto turned it on: say so
        if cfg.optim.grad_clip > 0:  # each step's two passes (LoRA: its one), as the dry run says
            console.print(escape(clipping_line(cfg, planned.plan)), highlight=False)
    checks.before_claim(planned, where)
    cfg, console = join_world(cfg, console)
    # engine.seq_tile as the plan resolved it (auto: on this machine), recorded in config.yaml
    cfg = replace(cfg, engine=replace(cfg.engine, seq_tile=planned.plan.seq_tile))
    with stop_signals(), joined(cfg.engine.device) as d, claim(cfg, model, console, d) as rd:
        phase("locked")
        if rd.finished():
            console.print(
                f"{rd.path}: complete at step {rd.resume_step} (train.steps {cfg.train.steps}); nothing to do",
                highlight=False,
            )
            return {"step": rd.resume_step, "checkpoint": str(rd.candidates[0]), "complete": True}
        with runtime_failures():
            return Trainer(
                cfg, model, rd, console, lora, dist=d, keep=planned.plan.kept, samples=samples
            ).run()


def rank_cfg(cfg: Config) -> Config:
    """The config as this rank runs it: under torchrun on its own GPU (cuda:LOCAL_RANK), so its fit
    and its kept layers are judged on its own device's free memory."""
    world, _, local = world_from_env()
    if world == 1:
        return cfg
    return replace(cfg, engine=replace(cfg.engine, device=rank_device(cfg.engine.device, local)))


def check_split(cfg: Config, world: int) -> None:
    """The global batch splits into the same number of micro-batches on every rank (as the run's
    recipe counts it: rl, batch_size x G completions)."""
    recipe_for(cfg).check_ranks(cfg, world)


def join_world(cfg: Config, console: Console) -> tuple[Config, Console]:
    """Under torchrun (WORLD_SIZE > 1): check the batch splits, put this rank on its own GPU
    (cuda:LOCAL_RANK), and let only rank 0 print."""
    world, rank, local = world_from_env()
    if world == 1:
        return cfg, console
    check_split(cfg, world)
    cfg = replace(cfg, engine=replace(cfg.engine, device=rank_device(cfg.engine.device, local)))
    return cfg, console if rank == 0 else Console(quiet=True)
