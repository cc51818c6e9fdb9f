"""The recipe seam: what a training method gives the train loop, the dry run and the data stage.

A recipe (one folder under recipes/, one line in recipes.registry) owns everything that makes its
method: the objective the engine runs (engine.seams.LossObjective), the batches the loop trains on
(Batches: step, eval batches, metrics, progress line, the state it keeps before step 1), its
checks of the data against the config, its dry-run plan terms and its data form. The loop, the
dry run and the data stage call these and name no method; the engine runs the objective it is
given and names none either.

    Recipe.wants(cfg)        whether the config asks for this method (the registry takes the first)
    Recipe.form              the data format it trains on (data.format: "preference", "unpaired",
                             "prompt"), None: token rows of any format no other recipe owns
    Recipe.hint(cfg)         data of its form under another method: what the config should say
    Recipe.refusal(cfg, data)   it was asked for, the data is of another form: why not
    Recipe.check_ranks(cfg, world)   its global batch splits into the same micro-batches on every rank
    Recipe.batches(cfg, data)   the run's Batches
    Recipe.plan(cfg, data, model)   the dry run's terms: key -> a JSON-able dict whose "text" is printed
    Recipe.read_data(...)    the data in the method's own form, or None: records as data.prepare reads them
    Recipe.data_section(cfg)   the `data:` section as data.prepare reads the method's records
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rich.console import Console

from ..arch.spec import ArchSpec
from ..config import Config
from ..config.schema import DataConfig
from ..data import PreparedData
from ..data.batch import MicroBatch
from ..engine import Engine
from ..engine.seams import LossObjective
from ..store import Store

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..data.prompt_only import PromptImages

Metrics = dict[str, float | None]  # a step's (or an evaluation's) entries of the metrics row
PlanTerms = dict[str, dict[str, object]]  # the dry run's: key in --json -> the term ("text": printed)


@dataclass(frozen=True)
class Attached:
    """What a recipe's batches may use once the engine is built (before the run dir changes)."""

    engine: Engine
    store: Store
    run_dir: Path
    console: Console
    main: bool  # this rank writes the run dir


@dataclass(frozen=True)
class PlanModel:
    """The model as the dry run plans it: its architecture, dtype, quantization ("" or "nf4"), the
    device bytes free between steps (None: no device given) and the ranks."""

    arch: ArchSpec
    dtype: str
    quant: str
    device_free: int | None
    world: int


class Batches(Protocol):
    """What a run's steps train on, decided once (Recipe.batches)."""

    @property
    def objective(self) -> LossObjective | None:
        """What the engine's head computes (None: its default, token cross-entropy)."""
        ...

    def attach(self, run: Attached) -> None:
        """Once the engine is built: what a strategy that drives it needs (grpo: the sampler)."""
        ...

    def prepare(self, start: int) -> None:
        """Before the first step of this start (`start`: the step resumed from, 0 on a fresh run):
        state the method computes once or reads back (preference, kto: the reference log-probs)."""
        ...

    def close(self) -> None:
        """When the run ends: what the batches hold (grpo: the reference engine)."""
        ...

    def step(self, step: int) -> tuple[list[MicroBatch], int]:
        """The global batch of `step` as micro-batches, and its tokens without padding."""
        ...

    def eval_batches(self) -> Iterator[list[MicroBatch]]:
        """The held-out data, a global batch at a time."""
        ...

    def metrics(self, stats: dict[str, float], n: int, prefix: str = "") -> Metrics:
        """The objective's stat sums over `n` (the divisor) -> the row's entries, names `prefix`ed."""
        ...

    def show(self, row: Mapping[str, object]) -> str:
        """What the progress line adds for this method."""
        ...


class Recipe(Protocol):
    name: str

    form: str | None

    def wants(self, cfg: Config) -> bool: ...
    def hint(self, cfg: Config) -> str: ...
    def refusal(self, cfg: Config, data: PreparedData) -> str: ...
    def check_ranks(self, cfg: Config, world: int) -> None: ...
    def batches(self, cfg: Config, data: PreparedData) -> Batches: ...
    def plan(self, cfg: Config, data: PreparedData | None, model: PlanModel) -> PlanTerms: ...
    def read_data(
        self,
        cfg: Config,
        tokenizer: Callable[[str], PreTrainedTokenizerBase | None],
        arch: ArchSpec,
        console: Console,
        images: Callable[[], PromptImages],
    ) -> PreparedData | None: ...
    def data_section(self, cfg: Config) -> DataConfig: ...
