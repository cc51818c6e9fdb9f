"""Supervised fine-tuning: token rows of any format no other recipe owns, cross-entropy over their
labels (the engine's default objective), no plan term of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.console import Console

from ...arch.spec import ArchSpec
from ...config import Config
from ...config.schema import DataConfig
from ...data import PreparedData
from ...parallel.shard import check_world
from ..recipe import PlanModel, PlanTerms
from .batches import SftBatches

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ...data.prompt_only import PromptImages


class Sft:
    name = "sft"
    form: str | None = None  # rows of any format the other recipes do not own

    def wants(self, cfg: Config) -> bool:
        return True  # last in the registry: what no other method claims

    def hint(self, cfg: Config) -> str:
        return ""  # owns no data form

    def refusal(self, cfg: Config, data: PreparedData) -> str:
        return ""

    def check_ranks(self, cfg: Config, world: int) -> None:
        """train.batch_size examples split into whole micro-batches, the same number on every rank."""
        check_world(cfg.train.batch_size, cfg.train.micro_batch_size, world)

    def batches(self, cfg: Config, data: PreparedData) -> SftBatches:
        return SftBatches(cfg, data)

    def plan(self, cfg: Config, data: PreparedData | None, model: PlanModel) -> PlanTerms:
        return {}

    def read_data(
        self,
        cfg: Config,
        tokenizer: Callable[[str], PreTrainedTokenizerBase | None],
        arch: ArchSpec,
        console: Console,
        images: Callable[[], PromptImages],
    ) -> PreparedData | None:
        return None  # records as data.prepare reads them

    def data_section(self, cfg: Config) -> DataConfig:
        return cfg.data


SFT = Sft()
