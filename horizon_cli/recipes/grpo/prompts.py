"""GRPO's data as its recipe reads it (recipe.Grpo.read_data): prompt sets (data.prompt_only), in a
PreparedData whose `train` and `eval` are typed for the token sets the other recipes read."""

from __future__ import annotations

from typing import Protocol, cast

from ...data import PreparedData
from ...data.prepare import RowSet
from ...data.prompt_only import PromptSet


class PromptData(Protocol):
    @property
    def train(self) -> PromptSet: ...
    @property
    def eval(self) -> PromptSet | None: ...
    @property
    def pad_id(self) -> int: ...


def prepared(train: PromptSet, ev: PromptSet | None, pad_id: int) -> PreparedData:
    """The prompts as the loop carries a run's data (read back by prompt_data)."""
    return PreparedData(cast(RowSet, train), cast(RowSet | None, ev), "prompt", pad_id)


def prompt_data(data: PreparedData) -> PromptData:
    """The prompts of an rl run's data (what Grpo.read_data put there)."""
    return cast(PromptData, data)
