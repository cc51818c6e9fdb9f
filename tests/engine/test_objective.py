"""The objective seam (engine/objective.py): a two-pass sequence objective, here cross-entropy
written as a function of per-token log-probs, gives the step TokenCE gives (loss, gradients and
the update), on the native and the generic path, full fine-tuning and LoRA."""

from __future__ import annotations

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, LoraConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.engine.objective import SequenceObjective, Targets
from horizon_cli.lora.setup import lora_setup
from tests.support.oracle import make_store, micro_batches, one_thread, random_rows  # noqa: F401


class TwoPassCE(SequenceObjective):
    """sum(-log p) over the label tokens, through the two-pass path; stats: its per-token mean."""

    name = "two-pass-ce"

    def loss(self, logps: list[torch.Tensor], targets: list[Targets]):
        total = -torch.cat(logps).sum()
        return total, {"logps_sum": torch.cat(logps).sum()}


def engines(store, lora=None):
    ecfg = EngineConfig(device="cpu", dtype="float32", loss_chunk=7)  # several chunks per micro-batch
    ocfg = OptimConfig(kernel="torch", lr=1e-3, weight_decay=0.1)
    return [Engine(store, ecfg, ocfg, lora=lora, objective=obj) for obj in (None, TwoPassCE())]


@pytest.mark.parametrize("family,lora", [("llama", False), ("gemma2", False), ("llama", True)])
def test_two_pass_cross_entropy_equals_token_ce(tmp_path, family, lora):
    model, store = make_store(tmp_path, family, tie=family == "llama")
    setup = lora_setup(LoraConfig(r=4, targets="all-linear"), store.arch) if lora else None
    a, b = engines(store, setup)
    try:
        rows = random_rows(6, model.config.vocab_size)
        for step in range(3):
            mbs = micro_batches(rows[2 * step : 2 * step + 2] + rows[:1], 2)
            ra, rb = a.step(mbs, 1e-3), b.step(mbs, 1e-3)
            assert rb.tokens == ra.tokens
            assert rb.loss == pytest.approx(ra.loss, rel=1e-6)
            assert rb.grad_norm == pytest.approx(ra.grad_norm, rel=1e-5)
            assert rb.stats["logps_sum"] == pytest.approx(-ra.loss * ra.tokens, rel=1e-5)
            assert rb.weight_loads == ra.weight_loads == 2 * store.arch.n_layers
        a.wait(), b.wait()
        for u, st in a.host.units.items():
            torch.testing.assert_close(b.host[u].master(), st.master(), rtol=1e-5, atol=1e-6, msg=u)
    finally:
        a.close(), b.close()
