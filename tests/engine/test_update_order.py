"""A unit is streamed for the next step only after the CPU optimizer's update of it has landed.

The update of step t overlaps step t+1's forward, unit by unit; each load waits for its unit's
update (the loader's `ready` events). On a tiny model the optimizer is far ahead of the loads, so
a load that forgot to wait would still see updated weights and every other test would pass. Here
the update of layer 2 is held until step 2's layer-1 forward has begun, after the load of layer 2
was requested: that load must wait for it, or step 2 computes layer 2 with step 1's weights. The
run must be bitwise the unheld one.
"""

from __future__ import annotations

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.runtime.trace import Tracer
from horizon_cli.state.optimizer import OptimizerWorker
from tests.support.oracle import (  # noqa: F401
    StartSignal,
    engine_weights,
    make_store,
    micro_batches,
    one_thread,
    random_rows,
)


def train(store, link_gbps: float, tracer: Tracer | None = None):
    eng = Engine(
        store,
        EngineConfig(device="cpu", dtype="float32", prefetch=2, link_gbps=link_gbps),
        OptimConfig(kernel="torch", lr=1e-2),
        tracer=tracer,
    )
    rows = random_rows(12, 96, seed=4)
    try:
        losses = [eng.step(micro_batches(rows[4 * s : 4 * s + 4], 2), 1e-2).loss for s in range(3)]
        eng.wait()
        return losses, engine_weights(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("link_gbps", [1e6, 0.0])  # copies (deterministic), and lent host memory
def test_a_unit_is_streamed_only_after_its_update(tmp_path, monkeypatch, link_gbps):
    _, store = make_store(tmp_path, "llama", False, num_hidden_layers=4)
    want_losses, want = train(store, link_gbps)

    signal = StartSignal("fwd 1", nth=2)  # step 2's layer-1 forward
    update = OptimizerWorker._update
    held = []

    def holding_update(self, st, h, dep):
        if st.name == "layer.2" and not held:
            held.append(signal.started.wait(timeout=30.0))
        return update(self, st, h, dep)

    monkeypatch.setattr(OptimizerWorker, "_update", holding_update)
    losses, got = train(store, link_gbps, signal)
    assert held == [True], "the hold was not released: layer 1's forward waited for layer 2's update"
    assert losses == want_losses
    for name, w in want.items():
        assert torch.equal(got[name], w), name
