"""HF checkpoint -> store (the first stage of the data flow)."""

from .convert import convert

__all__ = ["convert"]
