"""The base of the generic path's frozen description records (arch.generic_arch, arch.structure):
what keys the manifest a record was read from lacked, so that writing it back leaves them out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Record:
    """`absent`: the keys the manifest this was read from lacked (an older store), which `to_dict`
    leaves out again."""

    absent: frozenset[str] = field(default=frozenset(), kw_only=True, compare=False, repr=False)

    def _written(self, d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k not in self.absent}


def missing(d: Mapping[str, Any], keys: tuple[str, ...]) -> frozenset[str]:
    return frozenset(k for k in keys if k not in d)
