"""The host parameter store: layout, manifest, writer and reader (see docs/store-format.md)."""

from .layout import ALIGN, Slot, UnitLayout, layouts, unit_layout
from .manifest import DTYPES, Manifest, read_manifest
from .reader import Store
from .writer import StoreWriter

__all__ = [
    "ALIGN",
    "DTYPES",
    "Manifest",
    "Slot",
    "Store",
    "StoreWriter",
    "UnitLayout",
    "layouts",
    "read_manifest",
    "unit_layout",
]
