"""Preference optimization on pairs (a `preference:` section, loss dpo, cdpo, ipo, simpo or orpo):
pairs as data (data.pairs), the pair objective (loss), the reference pass before step 1 for the
referenced losses (reference) and its term in the dry run's plan."""

from __future__ import annotations

from ...config import Config
from ...data import PreparedData
from ..recipe import PlanModel, PlanTerms
from ..sft.recipe import Sft
from .batches import PairBatches
from .reference import reference_plan


class Preference(Sft):
    name = "preference"
    form: str | None = "preference"

    def wants(self, cfg: Config) -> bool:
        return cfg.preference is not None and cfg.preference.loss != "kto"

    def hint(self, cfg: Config) -> str:
        return (
            f"data.path: {cfg.data.where} holds preference pairs (format preference); add a preference: "
            "section to train on them (e.g. preference: {loss: dpo})"
        )

    def refusal(self, cfg: Config, data: PreparedData) -> str:
        assert cfg.preference is not None
        return (
            f"preference.loss: {cfg.preference.loss} trains on preference pairs (chosen, rejected); "
            f"data.path {cfg.data.where} is format {data.format} (data.format: preference reads pairs)"
        )

    def batches(self, cfg: Config, data: PreparedData) -> PairBatches:
        return PairBatches(cfg, data)

    def plan(self, cfg: Config, data: PreparedData | None, model: PlanModel) -> PlanTerms:
        """dpo, cdpo, ipo: the reference pass before step 1."""
        ref = reference_plan(cfg, data, model.arch.n_layers)
        return {} if ref is None else {"reference": ref}


PREFERENCE = Preference()
