"""What a converted store and a model planned from its config.json alone share (a dry run plans
from either): its files' root and its architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ..arch import ArchSpec


class ModelFiles(Protocol):
    """A store, or a model planned from its config.json (planning.ladder.PlannedModel, dry runs)."""

    @property
    def root(self) -> Path: ...
    @property
    def arch(self) -> ArchSpec: ...
