"""GRPO (an `rl:` section): prompts as data (data.prompt_only, read whole: nothing to cache), the
batches sampled on the current weights and scored each step (batches), the GRPO objective (loss),
and the rollouts' term in the dry run's plan (plan)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.console import Console

from ...arch.spec import ArchSpec
from ...config import Config
from ...config.schema import DataConfig
from ...data import PreparedData, pad_id_of
from ...data.prompt_only import prepare_prompts
from ...parallel.shard import check_completions
from ..recipe import PlanModel, PlanTerms
from .batches import GRPOBatches
from .plan import rollout_plan
from .prompts import prepared
from .tools import check_tokenizer, load_toolbox, with_tools

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ...data.prompt_only import PromptImages


class Grpo:
    name = "grpo"
    form: str | None = "prompt"

    def wants(self, cfg: Config) -> bool:
        return cfg.rl is not None

    def hint(self, cfg: Config) -> str:
        return f"data.path: {cfg.data.where} holds prompts; an rl: section trains on them"

    def refusal(self, cfg: Config, data: PreparedData) -> str:
        return f"rl: trains on prompts; data.path {cfg.data.where} is format {data.format}"

    def check_ranks(self, cfg: Config, world: int) -> None:
        """A step's batch_size x G completions, which one process splits freely, make the same
        number of micro-batches on every rank."""
        assert cfg.rl is not None
        if world > 1:
            check_completions(
                cfg.train.batch_size * cfg.rl.num_generations, cfg.train.micro_batch_size, world
            )

    def batches(self, cfg: Config, data: PreparedData) -> GRPOBatches:
        return GRPOBatches(cfg, data)

    def plan(self, cfg: Config, data: PreparedData | None, model: PlanModel) -> PlanTerms:
        """One step's rollouts on paper."""
        roll = rollout_plan(cfg, data, model.arch, model.dtype, model.quant, model.device_free, model.world)
        return {} if roll is None else {"rollouts": roll}

    def read_data(
        self,
        cfg: Config,
        tokenizer: Callable[[str], PreTrainedTokenizerBase | None],
        arch: ArchSpec,
        console: Console,
        images: Callable[[], PromptImages],
    ) -> PreparedData | None:
        """The prompts (data.prompt_only), read whole: nothing to cache."""
        assert cfg.rl is not None
        tok = tokenizer("auto")  # prompt_input_ids need none
        train, ev = prepare_prompts(
            cfg.data,
            tok,
            arch.vocab,
            arch.max_positions,
            cfg.rl.max_completion_length,
            cfg.train.seed,
            images(),
        )
        if (box := load_toolbox(cfg.rl)) is not None:  # the prompts rendered with the tools (TRL's)
            check_tokenizer(tok)
            room = min(cfg.data.max_seq_len, arch.max_positions) - cfg.rl.max_completion_length
            train = with_tools(train, box, tok, room, "data.path")
            ev = with_tools(ev, box, tok, room, "data.eval_path") if ev is not None else None
        console.print(
            f"data: {len(train):,} prompts" + (f", {len(ev):,} held out" if ev is not None else ""),
            highlight=False,
        )
        return prepared(train, ev, pad_id_of(tok, arch.vocab))

    def data_section(self, cfg: Config) -> DataConfig:
        return cfg.data


GRPO = Grpo()
