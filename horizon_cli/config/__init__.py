"""Config: the typed tree (schema) and its strict loader (load)."""

from .load import dump_yaml, load_config, to_dict
from .schema import Config

__all__ = ["Config", "dump_yaml", "load_config", "to_dict"]
