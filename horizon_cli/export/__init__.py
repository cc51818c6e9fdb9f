"""Store or run dir -> HF checkpoint (the last stage of the data flow)."""

from .export import export, resolve_source

__all__ = ["export", "resolve_source"]
