"""Architectures as data: `ArchSpec` flags (spec) and HF <-> store tensor tables (names)."""

from .names import TensorName, hf_table, unit_names, unit_tensors
from .spec import ArchSpec, read_hf_config, spec_from_hf

__all__ = [
    "ArchSpec",
    "TensorName",
    "hf_table",
    "read_hf_config",
    "spec_from_hf",
    "unit_names",
    "unit_tensors",
]
