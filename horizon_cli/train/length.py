"""How long a run is: `train.epochs` -> `train.steps`, once, from the data; notes on the length.

With `train.epochs`, the steps are ceil(epochs x training rows / train.batch_size) (an epoch is
one pass over the rows the sampler draws from: after packing, splitting long texts, the eval
split and the mixture weights; preference data counts pairs, as train.batch_size does). They are resolved before the run dir is claimed, so the
checkpoints, the resume checks (train/compat.py) and the loop read `train.steps` as if the
config had given it; the resolved config records both. Counting the rows tokenizes the data:
through the tokenization cache when it already exists (a resumed run, or `data.cache_dir`),
otherwise once more than a run with `train.steps` does on its first start.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from ..config import Config
from ..optim.schedules import lr_at


def resolve_length(cfg: Config, model, console: Console, dry_run: bool = False) -> Config:
    """cfg with train.steps resolved from train.epochs (if given), after the notes on its length."""
    speaks = os.environ.get("RANK", "0") == "0"  # under torchrun rank 0 speaks for every rank
    if cfg.train.epochs is not None:
        from .inputs import load_data  # the run's own reading of the data (tokenizer, vocab, cache)

        cache = Path(cfg.output.dir) / "cache"
        counting = replace(cfg, data=replace(cfg.data, cache_dir=None)) if dry_run else cfg  # writes nothing
        data = load_data(
            counting, model, cache if cache.is_dir() and not dry_run else None, Console(quiet=True)
        )
        steps = data.steps_for(cfg.train.epochs, cfg.train.batch_size)
        if speaks:
            console.print(
                f"train: train.epochs {cfg.train.epochs:g} of {len(data.train)} {data.unit} at train.batch_size "
                f"{cfg.train.batch_size} = train.steps {steps}",
                highlight=False,
            )
        cfg = replace(cfg, train=replace(cfg.train, steps=steps))
    note = warmup_note(cfg)
    if note and speaks:
        console.print(f"note: {note}", highlight=False)
    return cfg


def warmup_note(cfg: Config) -> str | None:
    s, steps = cfg.schedule, cfg.train.steps
    if steps is None or not s.warmup_steps or s.warmup_steps < steps:
        return None
    last = lr_at(steps - 1, lr=cfg.optim.lr, total=steps, kind=s.kind, warmup=s.warmup_steps)
    return (
        f"schedule.warmup_steps {s.warmup_steps} is not shorter than the run (train.steps {steps}): the "
        f"learning rate never reaches optim.lr {cfg.optim.lr:g} (the last step uses {last:.3g})"
    )
