"""A run resumed inside an rl.num_iterations group across the typed payloads: rollouts/step-N.pt
written before them holds micro-batches with an `extras` dict ("adv", "rows", "old", "ref")."""

from __future__ import annotations

import torch

from horizon_cli.data.batch import MicroBatch
from horizon_cli.recipes.grpo.loss import GRPOPayload
from horizon_cli.recipes.grpo.rollouts import load_group, save_group


def test_a_group_saved_with_extras_loads_with_its_payload(tmp_path):
    (tmp_path / "rollouts").mkdir()
    mb = MicroBatch.from_rows([([1, 2, 3], [-100, 2, 3]), ([4, 5], [-100, 5])], pad_id=0)
    adv, old = torch.tensor([0.5, -0.5]), torch.randn(2, 3)
    del mb.payload  # as the old class had no such field
    mb.extras = {"adv": adv, "rows": torch.tensor(2), "old": old}
    save_group(tmp_path, 3, {"mbs": [mb], "metrics": {"reward": 1.0}})

    got = load_group(tmp_path, 3)

    assert got is not None and got["metrics"] == {"reward": 1.0}
    (back,) = got["mbs"]
    assert isinstance(back.payload, GRPOPayload) and "extras" not in vars(back)
    assert torch.equal(back.payload.adv, adv) and back.payload.rows == 2
    assert torch.equal(back.payload.old, old) and back.payload.ref is None


def test_a_group_saved_with_its_payload_loads_unchanged(tmp_path):
    (tmp_path / "rollouts").mkdir()
    mb = MicroBatch.from_rows([([1, 2, 3], [-100, 2, 3])], pad_id=0)
    mb.payload = GRPOPayload(torch.tensor([1.0]), 1, None, torch.zeros(1, 3))
    save_group(tmp_path, 0, {"mbs": [mb], "metrics": {}})
    (back,) = load_group(tmp_path, 0)["mbs"]
    assert back.payload.rows == 1 and torch.equal(back.payload.ref, torch.zeros(1, 3))
