"""May a run resume with this config? Which settings changed since its checkpoint was written.

A checkpoint stores the resolved config it was trained with (state/config.yaml). Resuming with
a setting that changes the run's trajectory (data, batch sizes, seed, optimizer, schedule,
max_seq_len, packing, dtype, ...) is refused with the list of changed keys, unless the config
accepts exactly those keys: `train.accept_changes: [optim.lr]` (a section name accepts all of its
keys). Every key is a trajectory key except the FREE ones below: how long to train, how often
to log, evaluate and save, where to write, and how the same arithmetic is carried out.

How long to train is free only while it leaves the learning rate alone (`check_steps`): under a
decaying schedule (linear, cosine, warmup then decay) the lr of every step after warmup depends on
train.steps, so a change under which the steps already trained would have run at another lr is a
trajectory change (the resumed run would be no run its config describes), refused with the lr
before and after unless `train.accept_changes` names train.steps. With a constant schedule (or
inside the warmup) train.steps may grow, or shrink down to the step reached. Below the step the
run dir's checkpoint reached it is refused always: those steps are trained.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import yaml

from ..config import Config, to_dict
from ..errors import InputError
from ..optim.schedules import lr_at

FREE = (
    "train.steps",  # free of the listing below, but checked for its lr (check_steps)
    "train.epochs",  # how train.steps was given; its steps are compared as train.steps
    "train.eval_every",
    "train.eval_batches",
    "train.max_bad_steps",
    "train.accept_changes",
    "train.samples",  # what is shown at each eval, not what is trained
    "train.sample_tokens",
    "model.path",  # the model itself is compared by fingerprint, wherever it lives
    "data.cache_dir",
    "engine.device",
    "engine.prefetch",
    "engine.compute_threads",
    "engine.link_gbps",
    "engine.link_chaos",  # a transport for tests: the same arithmetic, bitwise
    "engine.loss_chunk",
    "engine.keep_activations",  # kept or recomputed, the same arithmetic (the graph recompute would build)
    "engine.kv_cache",
    "engine.seq_tile",  # tiled or not, the same arithmetic per token (weight gradients summed by tile)
    "optim.kernel",
    # released or not, the same training (grad_clip 0: bit for bit; > 0: the exact norm, norm-first)
    # and the same state files; auto may resolve otherwise on another machine (planning.release)
    "optim.grad_release",
    "output",
    "log",
)


# Keys that shape what a checkpoint holds: another value cannot read its state (lean's compressed
# moments are not exact's; rank-r adapters are not rank-r' ones), so a change is refused even when
# accepted. engine.dtype is refused before this (RunDir: the model and state checks).
STATE = ("optim.memory", "lora.r")

# sections that may be null (lora, a method's: preference, rl): switching one on or off changes the run
OPTIONAL = tuple(f.name for f in fields(Config) if f.default is None)


def flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def changes(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every trajectory key that differs. Keys present on
    one side only (a config written by another horizon version) are not compared."""
    a, b = flat(old), flat(new)
    out = [(k, a[k], b[k]) for k in b if k in a and a[k] != b[k] and not _under(k, FREE)]
    for sec in OPTIONAL:  # an optional section switched on or off (null on one side)
        on_a, on_b = (any(k.startswith(sec + ".") for k in side) for side in (a, b))
        if on_a != on_b and (sec in a or sec in b):
            out.append((sec, old.get(sec), new.get(sec)))
    return out


def check_accept_keys(cfg: Config) -> None:
    known = flat(to_dict(cfg))
    sections = {k.split(".")[0] for k in known}
    for e in cfg.train.accept_changes:
        if e not in known and e not in sections:
            raise InputError(f"train.accept_changes: {e!r} is not a config key (e.g. optim.lr)")


def check_resume(old_config_text: str | None, cfg: Config, where: str, step: int) -> list[str]:
    """Refuse (InputError) unless every trajectory change is accepted; returns the accepted
    changes as printable lines. step: the step the checkpoint `where` holds."""
    if old_config_text is None:
        return []
    old = yaml.safe_load(old_config_text) or {}
    steps = check_steps(old, cfg, where, step)
    diff = changes(old, to_dict(cfg))
    state = [d for d in diff if d[0] in STATE]
    if state:
        listing = ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in state)
        raise InputError(
            f"output.dir: {where} was trained with other settings that change the run: {listing}; "
            f"its state cannot be resumed with another {' or '.join(k for k, _, _ in state)} "
            "(not even with train.accept_changes): use another output.dir"
        )
    refused = [d for d in diff if not _under(d[0], cfg.train.accept_changes)]
    lines = [f"{k} {_show(a)} -> {_show(b)}" for k, a, b in refused]
    keys = [k for k, _, _ in refused]
    if steps is not None and not _under("train.steps", cfg.train.accept_changes):
        lines, keys = [*lines, steps], [*keys, "train.steps"]
    if keys:
        raise InputError(
            f"output.dir: {where} was trained with other settings that change the run: {', '.join(lines)}; "
            f"to resume with them anyway add train.accept_changes=[{','.join(keys)}], or use another output.dir"
        )
    return [f"{k} {_show(a)} -> {_show(b)}" for k, a, b in diff] + ([steps] if steps else [])


def _lr(step: int, total: int, optim: dict, schedule: dict) -> float:
    """The lr of 0-based step `step` (as the train loop computes it) over `total` steps."""
    return lr_at(
        step,
        lr=float(optim["lr"]),
        total=total,
        kind=schedule["kind"],
        warmup=int(schedule.get("warmup_steps", 0)),
        min_ratio=float(schedule.get("min_lr_ratio", 0.0)),
    )


def _moved(step: int, was: int, new: int, optim: dict, schedule: dict) -> bool:
    """Would any of the `step` steps already trained have run at another lr with a total of `new`
    steps than with `was`, all else as the new config has it (the steps' effect alone)?"""
    if schedule["kind"] == "constant":  # warmup and constant: the total is never read
        return False
    # under a decay the last trained step moves whenever any does: look there first
    return any(_lr(k, was, optim, schedule) != _lr(k, new, optim, schedule) for k in range(step - 1, -1, -1))


def check_steps(old: dict, cfg: Config, where: str, step: int) -> str | None:
    """train.steps against the run's. Below `step` it is refused (InputError). Otherwise None when
    the steps already trained would have run at the same lr with the new train.steps (so the
    resumed run is the run its config describes), else how the lr moves: a trajectory change for
    check_resume to refuse unless accepted."""
    new = cfg.train.steps
    was = (old.get("train") or {}).get("steps", new)
    if new < step:
        raise InputError(
            f"train.steps: {new} is below step {step}, which {where} has already trained "
            f"(train.steps {was}); give train.steps {step} or more, or use another output.dir"
        )
    d = to_dict(cfg)
    if new == was or not _moved(step, was, new, d["optim"], d["schedule"]):
        return None
    ran = _lr(step - 1, was, old.get("optim") or d["optim"], old.get("schedule") or d["schedule"])
    then = _lr(step - 1, new, d["optim"], d["schedule"])
    nxt = (
        f"step {step + 1} would run at {_lr(step, new, d['optim'], d['schedule']):.3g}"
        if new > step
        else "the run would end there"
    )
    return (
        f"train.steps {was} -> {new} moves the learning rate of the {cfg.schedule.kind} schedule: "
        f"step {step} ran at {ran:.3g}, {nxt} (train.steps {new} from the start: step {step} at {then:.3g})"
    )


def _show(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()
