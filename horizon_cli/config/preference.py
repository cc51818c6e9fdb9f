"""The `preference:` section's cross-field checks: what it trains on, and no setting left unused.

A setting the chosen loss does not use is refused, naming it, rather than silently ignored: a key
counts as set when its value is not the default (a run's config.yaml writes every key at its
value, so it stays loadable). `label_smoothing` with `loss: dpo` is refused because TRL 1.16's
DPOTrainer (loss_type sigmoid) ignores it: conservative DPO is `loss: cdpo` here.
"""

from __future__ import annotations

import dataclasses

from .schema import Config, PreferenceConfig

USES = {
    "label_smoothing": ("cdpo", "simpo"),
    "simpo_gamma": ("simpo",),
    "desirable_weight": ("kto",),
    "undesirable_weight": ("kto",),
}
FORMATS = ("preference", "unpaired")  # pairs; kto's unpaired examples (label or kto_tag)


def preference_problems(cfg: Config) -> list[str]:
    pref = cfg.preference
    if pref is None:
        given = ["data.format"] * (cfg.data.format in FORMATS) + [
            f"data.path[{i}].format" for i, fmt in source_formats(cfg) if fmt in FORMATS
        ]
        return (
            [f"{given[0]}: preference pairs need a preference: section (e.g. preference: {{loss: dpo}})"]
            if given
            else []
        )
    p = []
    want = "unpaired" if pref.loss == "kto" else "preference"
    what = "unpaired preference examples (label or kto_tag)" if pref.loss == "kto" else "preference pairs"
    if cfg.data.format not in ("auto", want):
        p.append(
            f"preference.loss: {pref.loss} trains on {what}; data.format {cfg.data.format} "
            f"is not (use data.format: {want} or auto)"
        )
    for i, fmt in source_formats(cfg):
        if fmt not in ("auto", want):
            p.append(
                f"data.path[{i}].format: {fmt} is not {what}, and preference.loss {pref.loss} "
                f"trains on {'those' if pref.loss == 'kto' else 'pairs'} only (use format: {want} or auto)"
            )
    if cfg.data.packing:
        p.append(
            "data.packing: preference pairs are not packed (a pair's two sequences stay whole); set it false"
        )
    if cfg.data.train_on_prompt:
        p.append(
            f"data.train_on_prompt: preference.loss {pref.loss} compares the pair's completions and puts "
            "no loss on the prompt (as TRL does); set it false"
        )
    for key, losses in USES.items():
        if pref.loss not in losses and getattr(pref, key) != _default(key):
            p.append(_unused(key, pref.loss, losses))
    return p


def _unused(key: str, loss: str, losses: tuple[str, ...]) -> str:
    if key == "label_smoothing" and loss == "dpo":
        return (
            "preference.label_smoothing: loss dpo is TRL 1.16's DPOTrainer loss_type sigmoid, which "
            "ignores label_smoothing; for conservative DPO set preference.loss: cdpo, or remove it"
        )
    return f"preference.{key}: only {' and '.join(losses)} use{'s' * (len(losses) == 1)} it, not {loss}"


def _default(key: str):
    return next(f.default for f in dataclasses.fields(PreferenceConfig) if f.name == key)


def source_formats(cfg: Config) -> list[tuple[int, str]]:
    """(index, format) of each source of a list `data.path` that names its own format."""
    path = cfg.data.path
    return [(i, s.format) for i, s in enumerate(path) if s.format] if isinstance(path, list) else []
