"""The training methods, in the order the config is asked (the first that wants it is the run's),
and the check that the data goes with the one chosen. Adding a method: its folder under recipes/
and one line here."""

from __future__ import annotations

from ..config import Config
from ..data import PreparedData
from ..errors import InputError
from .grpo.recipe import GRPO
from .kto.recipe import KTO
from .preference.recipe import PREFERENCE
from .recipe import Batches, Recipe
from .sft.recipe import SFT

RECIPES: tuple[Recipe, ...] = (
    GRPO,  # rl: online RL on prompts
    KTO,  # preference: {loss: kto}, unpaired examples
    PREFERENCE,  # preference: {loss: dpo | cdpo | ipo | simpo | orpo}, pairs
    SFT,  # anything else: token rows
)


def recipe_for(cfg: Config) -> Recipe:
    """The run's method, decided once from the config."""
    return next(r for r in RECIPES if r.wants(cfg))


def checked(cfg: Config, data: PreparedData) -> Recipe:
    """The run's method, its data's form checked: data another method owns names that method's
    section (hint); the chosen method's own form refuses any other data (refusal)."""
    chosen = recipe_for(cfg)
    for r in RECIPES:
        if r is chosen:
            if r.form is not None and data.format != r.form:
                raise InputError(r.refusal(cfg, data))
            break
        if r.form is not None and data.format == r.form:
            raise InputError(r.hint(cfg))
    return chosen


def batches_for(cfg: Config, data: PreparedData) -> Batches:
    """The run's batches (train's loop asks once)."""
    return checked(cfg, data).batches(cfg, data)
