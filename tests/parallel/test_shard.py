"""The shard rule: every element of a unit is held by exactly one rank, as torch.chunk splits."""

import pytest
import torch

from horizon_cli.errors import InputError
from horizon_cli.parallel.shard import check_world, shard_range, shard_size


@pytest.mark.parametrize("numel", [0, 1, 5, 63, 64, 65, 1000, 4097])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("align", [1, 64])
def test_every_element_once(numel, world, align):
    owner = torch.zeros(numel, dtype=torch.int64)
    for r in range(world):
        a, b = shard_range(numel, world, r, align)
        assert 0 <= a <= b <= numel and b - a <= shard_size(numel, world, align)
        assert a % align == 0 or a == numel
        owner[a:b] += 1
    assert bool((owner == 1).all())


@pytest.mark.parametrize("numel,world", [(10, 3), (7, 4), (5, 4), (64, 8)])
def test_matches_torch_chunk(numel, world):
    flat = torch.arange(numel)
    chunks = torch.chunk(flat, world)
    for r in range(world):
        a, b = shard_range(numel, world, r)
        want = chunks[r] if r < len(chunks) else flat[:0]
        assert torch.equal(flat[a:b], want)


def test_check_world():
    check_world(8, 2, 4)
    check_world(6, 1, 3)
    with pytest.raises(InputError, match="train.batch_size: 8 .* multiple of 6"):
        check_world(8, 2, 3)
