"""May a run resume with this config? Which settings changed since its checkpoint was written.

A checkpoint stores the resolved config it was trained with (state/config.yaml). Resuming with
a setting that changes the run's trajectory (data, batch sizes, seed, optimizer, schedule,
max_seq_len, packing, dtype, ...) is refused with the list of changed keys, unless the config
accepts exactly those keys: `train.accept_changes: [optim.lr]` (a section name accepts all of its
keys). Every key is a trajectory key except the FREE ones below: how long to train, how often
to log, evaluate and save, where to write, and how the same arithmetic is carried out.
"""

from __future__ import annotations

from typing import Any

import yaml

from ..config import Config, to_dict
from ..errors import InputError

FREE = (
    "train.steps",  # may grow: the run continues; at or below the checkpoint's step it is complete
    "train.eval_every",
    "train.eval_batches",
    "train.max_bad_steps",
    "train.accept_changes",
    "model.path",  # the model itself is compared by fingerprint, wherever it lives
    "data.cache_dir",
    "engine.device",
    "engine.prefetch",
    "engine.compute_threads",
    "engine.link_gbps",
    "engine.loss_chunk",
    "engine.keep_activations",  # kept or recomputed, the same arithmetic (the graph recompute would build)
    "optim.kernel",
    "output",
    "log",
)


# Keys that shape what a checkpoint holds: another value cannot read its state (lean's compressed
# moments are not exact's; rank-r adapters are not rank-r' ones), so a change is refused even when
# accepted. engine.dtype is refused before this (RunDir: the model and state checks).
STATE = ("optim.memory", "lora.r")

OPTIONAL = ("lora",)  # sections that may be null: switching one on or off changes the run


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


def check_resume(old_config_text: str | None, cfg: Config, where: str) -> list[str]:
    """Refuse (InputError) unless every trajectory change is accepted; returns the accepted
    changes as printable lines."""
    if old_config_text is None:
        return []
    old = yaml.safe_load(old_config_text) or {}
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
    if refused:
        listing = ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in refused)
        keys = ",".join(k for k, _, _ in refused)
        raise InputError(
            f"output.dir: {where} was trained with other settings that change the run: {listing}; "
            f"to resume with them anyway add train.accept_changes=[{keys}], or use another output.dir"
        )
    return [f"{k} {_show(a)} -> {_show(b)}" for k, a, b in diff]


def _show(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()
