"""Two ranks under the chaos transport (engine.link_chaos, runtime/chaos.py): the sharded step
(all-gathered weights, reduce-scattered gradients, the collective thread, evaluation's totals)
gives bitwise the numbers of the plain transport."""

from __future__ import annotations

import json

import pytest
import torch

from tests.parallel.test_dist import config, torchrun, weights


@pytest.mark.slow  # torchrun x 2; tests/runtime/test_chaos.py keeps the chaos transport fast
def test_two_ranks_under_chaos_equal_the_plain_transport(tiny_store, tmp_path):
    runs = {}
    for chaos in (False, True):
        name = "chaos" if chaos else "plain"
        cfg = config(tmp_path, tiny_store, name,
                     train={"steps": 4, "batch_size": 8, "micro_batch_size": 2, "eval_every": 2, "eval_batches": 1},
                     data={"eval_fraction": 0.21}, output={"save_every": 4, "export": True},
                     engine={"link_chaos": chaos})  # fmt: skip
        r = torchrun(2, cfg)
        assert r.returncode == 0, r.stderr[-3000:]
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = (rows, weights(tmp_path / name))
    keys = ("loss", "grad_norm", "eval_loss")
    a, b = ([[r.get(k) for k in keys] for r in runs[n][0]] for n in ("plain", "chaos"))
    assert a == b and len(a) == 4 and any(r[2] is not None for r in a)
    wa, wb = runs["plain"][1], runs["chaos"][1]
    assert wa and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
