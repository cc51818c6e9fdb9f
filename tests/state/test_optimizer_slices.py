"""Units larger than one optimizer slice: AdamW walks a unit in slices of `SLICE` elements
(engine/optimizer.py, 4M: 16 MiB of fp32) so the torch path's temporaries stay small. No tiny test
model has a unit that large, so here the slice is lowered to 1000 elements, which cuts every unit
of the tiny Llama (9k-element layers, a 3k-element embedding) into several slices and an odd
tail: each slice must read its own gradient, moments and master, and write its own.

The result must be bitwise that of whole-unit updates (AdamW is elementwise), and, in fp32, match
the resident transformers + torch.optim.AdamW run.
"""

from __future__ import annotations

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.optim import native
from horizon_cli.state import slices
from tests.engine.test_engine_training import HP, batches, run_engine
from tests.support.oracle import DEVICE, engine_weights, hf_train_hp, make_store, one_thread  # noqa: F401

SMALL = 1000  # elements per slice in these tests; no unit of the model is a multiple of it


def run(store, dtype: str, kernel: str, data) -> tuple[list[float], dict[str, bytes]]:
    eng = Engine(
        store, EngineConfig(device=DEVICE, dtype=dtype, loss_chunk=16), OptimConfig(kernel=kernel, **HP)
    )
    try:
        losses = [r.loss for r in run_engine(eng, data, HP["lr"])]
        state = {
            f"{u}.{k}": t.view(torch.uint8).numpy().tobytes()
            for u, st in eng.host.units.items()
            for k, t in st.buffers().items()
            if k != "grad"
        }
        return losses, state
    finally:
        eng.close()


@pytest.mark.parametrize("kernel", ["torch", "native"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sliced_updates_equal_whole_unit_updates(tmp_path, monkeypatch, dtype, kernel):
    if kernel == "native" and not native.available():
        pytest.skip(f"native AdamW kernel unavailable: {native.reason()}")
    model, store = make_store(tmp_path, "llama", False, dtype=dtype)
    data = batches(model.config.vocab_size, micro=2, steps=3)
    sizes = [store.layout(u.name).trainable_numel for u in store.units]
    assert all(n > 2 * SMALL and n % SMALL for n in sizes), sizes  # several slices and a tail each
    whole = run(store, dtype, kernel, data)
    monkeypatch.setattr(slices, "SLICE", SMALL)
    sliced = run(store, dtype, kernel, data)
    assert sliced[0] == whole[0]
    assert sliced[1].keys() == whole[1].keys()
    for key in whole[1]:
        assert sliced[1][key] == whole[1][key], key


def test_sliced_updates_match_resident_adamw(tmp_path, monkeypatch):
    model, store = make_store(tmp_path, "llama", False)
    data = batches(model.config.vocab_size, micro=2, steps=5)
    monkeypatch.setattr(slices, "SLICE", SMALL)
    eng = Engine(
        store, EngineConfig(device=DEVICE, dtype="float32", loss_chunk=16), OptimConfig(kernel="torch", **HP)
    )
    try:
        run_engine(eng, data, HP["lr"])
        ours = engine_weights(eng)
    finally:
        eng.close()
    hf_train_hp(model, data, HP)
    for name, p in model.named_parameters():
        err = float((ours[name] - p.detach()).abs().max() / p.detach().abs().max())
        assert err < 1e-5, name
