"""The engine: the parts of a streamed run assembled once, a training step and forward-only passes
over them (see docs/engine.md)."""

from .engine import Engine, StepResult

__all__ = ["Engine", "StepResult"]
