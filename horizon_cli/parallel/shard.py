"""How a unit's flat buffers split across ranks, and the batch a world size needs.

Every unit is one flat buffer (store/layout.py). Rank r of `world` holds the elements
[r * size, min(numel, (r + 1) * size)) of each of the unit's flat buffers, with
size = ceil(numel / world) rounded up to `align` elements: `torch.chunk(flat, world)[r]` when
align is 1 (FSDP's dim-0 rule on a flat buffer). The last ranks may hold fewer elements, or none;
collectives that need equal pieces pad every piece to `size`.
"""

from __future__ import annotations

from ..errors import InputError

# elements: what every unit is sharded by (host slices, device pieces, gathers and scatters):
# pieces start on lean optimizer blocks (optim/lean.py BLOCK), so no block straddles two ranks
SHARD_ALIGN = 64


def shard_size(numel: int, world: int, align: int = 1) -> int:
    """Elements of the largest piece (every piece padded to it for all-gather/reduce-scatter)."""
    if world < 1 or align < 1:
        raise ValueError(f"world {world} and align {align} must be >= 1")
    per = -(-numel // world)
    return -(-per // align) * align


def padded_numel(numel: int, world: int) -> int:
    """Elements of a unit's whole device buffer in a sharded run: every rank's piece, padded."""
    return world * shard_size(numel, world, SHARD_ALIGN)


def check_completions(completions: int, micro_batch: int, world: int) -> None:
    """An rl step's completions (train.batch_size x rl.num_generations) cut into micro-batches of
    `micro_batch` (the last may be short) give the same number to every rank."""
    mbs = -(-completions // micro_batch)
    if mbs % world:
        raise InputError(
            f"train.micro_batch_size: the {completions} completions of a step (train.batch_size x "
            f"rl.num_generations) make {mbs} micro-batches of {micro_batch}, which do not split over "
            f"{world} ranks; make the micro-batches a multiple of {world}"
        )


def shard_range(numel: int, world: int, rank: int, align: int = 1) -> tuple[int, int]:
    """[start, end) of the elements rank `rank` holds; start == end when it holds none."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    size = shard_size(numel, world, align)
    start = min(numel, rank * size)
    return start, min(numel, start + size)


def check_world(batch: int, micro_batch: int, world: int) -> None:
    """The global batch splits into whole micro-batches, the same number on every rank."""
    if world < 1:
        raise InputError(f"world size: expected >= 1, got {world}")
    if batch % (micro_batch * world):
        raise InputError(
            f"train.batch_size: {batch} does not split into micro-batches of {micro_batch} "
            f"(train.micro_batch_size) on {world} ranks; make it a multiple of {micro_batch * world}"
        )
