"""One call, one value (model/call.py, docs/engine.md "One call, one value"): a training step
writes no attribute onto the layer template or the LoRA adapters for a call — what a call
computes with (its micro-batch, step, tile, train or eval, adapters) is the LayerCall it is
handed — and an equal value draws the same masks, another tile or micro-batch other ones."""

from __future__ import annotations

import os

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, LoraConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.lora.linear import LayerLora
from horizon_cli.lora.setup import lora_setup
from horizon_cli.model.call import TILE, LayerCall
from tests.engine.test_dropout import MODELS, SEED, store_of
from tests.support.oracle import micro_batches, random_rows


def rewrites(monkeypatch: pytest.MonkeyPatch, *classes: type) -> list[tuple[str, str]]:
    """From now on, every attribute of an instance of `classes` written again: (class, name)
    (what an object's constructor sets is its own; a call's fact written onto it is not)."""
    seen: list[tuple[str, str]] = []

    def spy(self: object, name: str, value: object) -> None:
        if name in vars(self):
            seen.append((type(self).__name__, name))
        object.__setattr__(self, name, value)

    for cls in classes:
        assert "__setattr__" not in vars(cls)
        monkeypatch.setattr(cls, "__setattr__", spy)
    return seen


@pytest.mark.parametrize("name,targets", [("llama-native", "all-linear"), ("phi", ["q_proj", "fc1"])])
def test_a_step_writes_nothing_onto_the_template_or_the_adapters(tmp_path, monkeypatch, name, targets):
    """Attention (or residual) dropout, LoRA dropout and tiles of 4 tokens: the step computes,
    and neither the template nor any LayerLora gets an attribute written while it does."""
    model = MODELS[name]()
    store = store_of(model, tmp_path)
    lora = lora_setup(LoraConfig(r=4, alpha=8, targets=targets, dropout=0.3), store.arch, seed=SEED)
    eng = Engine(
        store,
        EngineConfig(device="cpu", dtype="float32", loss_chunk=16, seq_tile=4),
        OptimConfig(kernel="torch", lr=1e-2, grad_clip=0.0),
        lora=lora,
        dropout_seed=SEED,
    )
    try:
        mbs = micro_batches(random_rows(4, model.config.vocab_size, seed=1, lo=10, hi=24), 2)
        keys: list[object] = []
        dropout = LayerLora._dropout

        def spy(self: LayerLora, name: str, x: torch.Tensor) -> torch.Tensor:
            keys.append(self.mb)
            return dropout(self, name, x)

        monkeypatch.setattr(LayerLora, "_dropout", spy)
        written = rewrites(monkeypatch, type(eng.p.tmpl), LayerLora)
        eng.forward_backward(mbs)
        monkeypatch.undo()
        assert written == [], written
        assert any(isinstance(k, tuple) and TILE in k for k in keys)  # the tiles' own masks drawn
    finally:
        eng.close()


def test_a_calls_key_names_its_masks():
    """The key of an equal value is equal (the recompute draws the forward's masks); a loop's
    later call, a tile and another micro-batch each name masks of their own."""
    x = torch.ones(3, 8)
    ab = {"wq": (torch.eye(8)[:2], torch.eye(8)[:, :2])}
    lora = LayerLora(ab, scaling=1.0, dropout=0.5, seed=11)

    def mask(call: LayerCall) -> torch.Tensor:
        adapters = call.adapters
        assert isinstance(adapters, LayerLora)
        return adapters._dropout("wq", x)

    call = LayerCall(call=3, layer=3, mb=5, step=2, train=True, tile=4, lora=lora)
    assert call.key == 5 and LayerCall(call=4, layer=3, mb=5).key == (5, 4)
    assert call.in_tile(8).key == (5, TILE, 8)
    assert torch.equal(
        mask(call), mask(LayerCall(call=3, layer=3, mb=5, step=2, train=True, tile=4, lora=lora))
    )
    others = [
        LayerCall(call=4, layer=3, mb=5, lora=lora),
        call.in_tile(8),
        LayerCall(call=3, layer=3, mb=6, lora=lora),
    ]
    assert all(not torch.equal(mask(call), mask(o)) for o in others)
    assert lora.mb == 0  # the layer's adapters themselves are never re-keyed


def test_a_tiles_mask_key_hashes_the_same_in_every_process():
    """LoRA dropout seeds from hash((seed, key, weight)): a tile's key must hash alike whatever
    PYTHONHASHSEED a process got, or a run resumed in a new process draws other masks (a str in
    the key did: str hashes are salted per process)."""
    import subprocess
    import sys

    code = (
        "from horizon_cli.model.call import TILE, LayerCall;"
        "print(hash((7, LayerCall(call=2, layer=2, mb=3).in_tile(64).key, 1)))"
    )
    seeds = []
    for salt in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": salt}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        seeds.append(out.stdout.strip())
    assert seeds[0] == seeds[1]
