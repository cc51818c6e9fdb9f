"""The world a run is planned for: how many ranks, how many on each node.

From `--world-size N [--nproc-per-node K]` on a dry run, else from torchrun's environment
(WORLD_SIZE, LOCAL_WORLD_SIZE), else one rank. Only the memory plan reads it here; the launch
itself is torchrun's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InputError


@dataclass(frozen=True)
class World:
    size: int = 1  # ranks in all
    per_node: int = 1  # ranks (GPUs) on each node

    @property
    def nodes(self) -> int:
        return -(-self.size // self.per_node)


def world_for(size: int | None, per_node: int | None, env: Mapping[str, str] | None = None) -> World:
    """The flags when given, else torchrun's variables, else one rank. A node holds `per_node`
    ranks (default: all of them, one node)."""
    if size is None and per_node is not None:
        raise InputError("--nproc-per-node: give it with --world-size (the ranks in all)")
    if size is not None:
        return checked(size, size if per_node is None else per_node, "--world-size", "--nproc-per-node")
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env:
        return World()
    n = env_int(env, "WORLD_SIZE")
    return checked(
        n,
        env_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else n,
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
    )


def env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise InputError(f"{name}: expected a whole number of ranks, got {env[name]!r}") from None


def checked(size: int, per_node: int, size_name: str, node_name: str) -> World:
    if size < 1:
        raise InputError(f"{size_name}: expected >= 1 ranks, got {size}")
    if not 1 <= per_node <= size or size % per_node:
        raise InputError(
            f"{node_name}: {per_node} ranks per node does not divide {size_name} {size} into whole nodes"
        )
    return World(size, per_node)
