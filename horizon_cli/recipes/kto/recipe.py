"""KTO (a `preference:` section with loss kto): unpaired examples as data (data.unpaired, each
with a mismatched completion), the KTO objective (loss), the reference pass before step 1 and its
term in the dry run's plan (recipes.preference.reference, as the referenced pair losses)."""

from __future__ import annotations

from dataclasses import replace

from ...config import Config
from ...config.schema import DataConfig
from ...data import PreparedData
from ..preference.recipe import Preference
from .batches import KTOBatches


class Kto(Preference):
    name = "kto"
    form: str | None = "unpaired"

    def wants(self, cfg: Config) -> bool:
        return cfg.preference is not None and cfg.preference.loss == "kto"

    def hint(self, cfg: Config) -> str:
        return (
            f"data.path: {cfg.data.where} holds unpaired preference examples (label or kto_tag); train them "
            "with preference: {loss: kto}"
        )

    def refusal(self, cfg: Config, data: PreparedData) -> str:
        return (
            f"preference.loss: kto trains on unpaired preference examples (label or kto_tag); "
            f"data.path {cfg.data.where} is format {data.format}"
        )

    def data_section(self, cfg: Config) -> DataConfig:
        """data.format auto reads KTO's examples as unpaired, preference pairs too: TRL's KTOTrainer
        unpairs them (data.unpaired)."""
        return replace(cfg.data, format="unpaired") if cfg.data.format == "auto" else cfg.data

    def batches(self, cfg: Config, data: PreparedData) -> KTOBatches:
        return KTOBatches(cfg, data)


KTO = Kto()
