"""Data stage 1a, the catalogue: `data.path` (and the eval keys) -> the sources to read.

    data.path: a string              one source (a file, a save_to_disk dir, a hub name), or a
                                     LLaMA-Factory dataset_info.json: one source per entry
    data.path: a list of sources     each {path, format, weight, split, names} (a string item is
                                     {path: it}); format and split default to data.format and
                                     data.split; `names` picks entries of a dataset_info.json
    data.eval_path                   a string: read like data.path (weights do not apply)
    data.eval_split                  the same sources as data.path, split `eval_split` each

A source's `weight` is how many times each of its rows is in an epoch (mixture.py); a registry
source's weight scales each of its entries'.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import InputError
from . import registry


@dataclass(frozen=True)
class Spec:
    """One source as the pipeline reads it."""

    path: str  # a local path or a hub name
    format: str  # as configured: auto or a format
    weight: float = 1.0
    split: str = "train"
    what: str = "data.path"  # the config key that names it, for messages
    label: str = ""  # how the mixture summary names it (the path, or the registry entry)
    rename: tuple[tuple[str, str], ...] = ()  # (dataset column, horizon field): a registry's columns
    tags: tuple[tuple[str, str], ...] = ()  # a registry's sharegpt tags
    text_column: str | None = None  # registry: read as `text` when the data has no output column
    num_samples: int | None = None  # registry: this many records' worth of rows
    hub_options: tuple[tuple[str, str], ...] = ()

    @property
    def mapping(self) -> dict:
        """What the cache key needs beyond the file: how its columns are read."""
        return {"rename": self.rename, "tags": self.tags, "text_column": self.text_column}


def train_specs(data_cfg) -> list[Spec]:
    path = data_cfg.path
    if isinstance(path, str):
        return _expand(path, data_cfg.format, 1.0, data_cfg.split, "data.path", None)
    specs: list[Spec] = []
    for i, src in enumerate(path):
        what = f"data.path[{i}]"
        specs += _expand(
            src.path, src.format or data_cfg.format, src.weight, src.split or data_cfg.split, what, src
        )
    labels = [s.label for s in specs]
    twice = next((x for x in labels if labels.count(x) > 1), None)
    if twice is not None:
        raise InputError(f"data.path: source {twice!r} is listed twice (give it a weight instead)")
    return specs


def eval_specs(data_cfg, train: list[Spec], fmt: str) -> list[Spec]:
    """The eval sources: eval_path's (in format `fmt`), or the train sources' eval_split."""
    if data_cfg.eval_path:
        return _expand(data_cfg.eval_path, fmt, 1.0, data_cfg.split, "data.eval_path", None)
    if data_cfg.eval_split:
        return [replace(s, split=data_cfg.eval_split, weight=1.0, num_samples=None,
                        what=f"{s.what} (data.eval_split)") for s in train]  # fmt: skip
    return []


def _expand(path: str, fmt: str, weight: float, split: str, what: str, src) -> list[Spec]:
    if not registry.is_registry(path):
        if src is not None and src.names is not None:
            raise InputError(f"{what}.names: picks entries of a {registry.FILE} registry; {path} is not one")
        return [Spec(path, fmt, weight, split, what, path)]
    if src is not None and (src.format or src.split):
        key = "format" if src.format else "split"
        raise InputError(f"{what}.{key}: a {registry.FILE} registry sets each entry's {key}; leave it out")
    # unpaired: KTO's auto (recipes.kto); a registry's KTO entries are unpaired already, and any
    # other entry is refused by the recipe naming its format
    if fmt not in ("auto", "unpaired") and what.startswith("data.path"):
        raise InputError(f"data.format: a {registry.FILE} registry sets each entry's format; leave it auto")
    entries = registry.read_registry(path, src.names if src is not None else None, what)
    return [
        Spec(
            e.path,
            e.format,
            weight,
            e.split,
            f"{what} ({path}: {e.name})",
            e.name,
            e.rename,
            e.tags,
            e.text_column,
            e.num_samples,
            e.hub_options,
        )  # fmt: skip
        for e in entries
    ]
