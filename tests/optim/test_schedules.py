import math

import pytest

from horizon_cli.optim.schedules import lr_at


def test_constant_with_warmup():
    lrs = [lr_at(s, lr=1.0, total=10, kind="constant", warmup=3) for s in range(10)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(x == 1.0 for x in lrs[3:])


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_decay_is_monotone_and_ends_near_the_floor(kind):
    total, floor = 50, 0.1
    lrs = [lr_at(s, lr=2.0, total=total, kind=kind, warmup=5, min_ratio=floor) for s in range(total)]
    assert lrs[0] == pytest.approx(2.0 / 6)
    assert lrs[5] == pytest.approx(2.0)  # peak right after warmup
    assert all(a >= b for a, b in zip(lrs[5:], lrs[6:], strict=False))
    assert 2.0 * floor < lrs[-1] < 2.0 * floor + 0.1  # above the floor: the last step still learns


def test_cosine_midpoint_and_linear_shape():
    assert lr_at(5, lr=1.0, total=10, kind="cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(5, lr=1.0, total=10, kind="linear") == pytest.approx(0.5)
    assert lr_at(0, lr=1.0, total=1, kind="cosine") == 1.0
