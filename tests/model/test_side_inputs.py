"""Tensors other than the hidden state that cross layers with a gradient (model.side): Gemma 4's
per-layer inputs (computed before the layers from the per-layer embedding and a projection of the
token embedding), Zamba 2's embedding output given to its hybrid layer, Zaya's router states that
each layer passes to the next. One fp32 step in 2 micro-batches against transformers (every
gradient, the per-layer embedding and projection included), the same with every layer kept
(engine.kept_layers: bitwise), KV sharing across layers (Gemma 4 with num_kv_shared_layers: the entries
a layer writes into `shared_kv_states`), and what stays refused at convert: a block tied across
layers (Zamba)."""

from __future__ import annotations

import pytest
import torch

from horizon_cli.config.schema import LoraConfig
from horizon_cli.convert import convert
from horizon_cli.errors import InputError
from horizon_cli.generate import decoder as loop
from horizon_cli.lora.setup import lora_setup
from horizon_cli.model.sample import Sampler
from horizon_cli.planning.memory import memory_plan
from horizon_cli.store import Store
from tests.engine.test_keep import assert_same, run
from tests.generate.test_generate import hf_greedy, prompts
from tests.generate.test_generate import run as generate
from tests.support.census_config import build, tiny_config
from tests.support.oracle import check_step_against_hf, make_engine, one_thread, rel_err  # noqa: F401 (autouse fixture)

CASES = {"gemma4_text": 3, "zamba2": 7, "zaya": 2}  # zamba2: its hybrid layer is the 7th


def tiny(tmp_path, mt: str, layers: int, **over):
    cfg = tiny_config(mt, layers)
    for k, v in over.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = build(mt, cfg).float().eval()
    with torch.no_grad():  # norms and biases away from their init, as the census does
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / "hf")
    return model


def store_of(tmp_path, mt: str, layers: int, **over):
    model = tiny(tmp_path, mt, layers, **over)
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    return model, Store.open(tmp_path / "store")


@pytest.mark.parametrize("mt", sorted(CASES))
def test_a_step_matches_transformers(tmp_path, mt):
    model, store = store_of(tmp_path, mt, CASES[mt])
    side = store.arch.generic["model"]
    assert side["side"] or any(p[0] for p in side["passes"]), "the case must have a crossing tensor"
    if mt == "gemma4_text":  # the plan holds the per-layer inputs of layers 1.. and their gradients
        width = (CASES[mt] - 1) * model.config.hidden_size_per_layer_input
        assert side["side_width"] == width
        assert memory_plan(store.arch, batch=4, seq=8).device["side inputs"] == 2 * 4 * 8 * width * 2
    eng = make_engine(store)
    try:
        check_step_against_hf(eng, model.train())
    finally:
        eng.close()


@pytest.mark.parametrize("mt", ["gemma4_text", "zaya"])
def test_kept_layers_equal_recomputed(tmp_path, mt):
    """Every layer kept (the producer of the side inputs too), and the top one only: bitwise the
    run that recomputes every layer; with LoRA adapters on every linear layer too."""
    _, store = store_of(tmp_path, mt, CASES[mt])
    ref = run(store, "float32", 0, steps=2)
    assert_same(ref, run(store, "float32", store.arch.n_layers, steps=2))
    assert_same(ref, run(store, "float32", 1, steps=2))

    def lora():
        return lora_setup(LoraConfig(r=4, alpha=8, targets="all-linear"), store.arch)

    ref = run(store, "float32", 0, lora=lora(), steps=2)
    assert_same(ref, run(store, "float32", store.arch.n_layers, lora=lora(), steps=2))


def test_lora_through_passed_router_states_matches_peft(tmp_path):
    """Zaya with adapters on the router's down_proj (whose output is the state each layer passes
    to the next) and o_proj: 3 steps of losses and adapter weights against peft + AdamW."""
    peft = pytest.importorskip("peft")
    from tests.lora.test_lora_engine import HP, batches, lora_engine, peft_model
    from tests.support.oracle import hf_train_hp

    model, store = store_of(tmp_path, "zaya", CASES["zaya"])
    targets = ["down_proj", "o_proj"]
    pm = peft_model(model.train(), targets)
    pm.save_pretrained(tmp_path / "init")
    data = batches(model.config.vocab_size, 3)
    eng = lora_engine(store, tmp_path / "init", targets)
    try:
        res = [eng.step(mbs, HP["lr"]) for mbs in data]
        eng.wait()
        ref = hf_train_hp(pm, data, HP)
        for r, l_ref in zip(res, ref, strict=True):
            assert abs(r.loss - l_ref) / l_ref < 1e-5
        ours, theirs = eng.host.tensors(), peft.get_peft_model_state_dict(pm)
        assert set(ours) == set(theirs) and any("gate.down_proj" in k for k in ours)
        for k in theirs:
            assert rel_err(ours[k], theirs[k]) < 1e-5, k
    finally:
        eng.close()


def test_gemma4_generates_as_transformers(tmp_path, monkeypatch):
    """Forward-only passes need nothing of the side inputs' machinery: greedy decoding with the
    per-layer inputs recomputed for each new token, prompts of unequal lengths in one batch."""
    monkeypatch.setattr(loop, "MICRO_TOKENS", 24)
    model, store = store_of(tmp_path, "gemma4_text", CASES["gemma4_text"])
    items = prompts(model.config.vocab_size, seed=3)
    want = [hf_greedy(model, ids, 6, None) for ids in items]
    assert generate(store, items, Sampler(), new=6) == want


def test_a_block_tied_across_layers_is_refused(tmp_path):
    tiny(tmp_path, "zamba", 8)
    with pytest.raises(InputError, match="shared_transf.*one tensor.*block shared across layers"):
        convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    assert not (tmp_path / "store").exists()


def test_kv_sharing_across_layers_trains(tmp_path):
    """Gemma 4's last layers (num_kv_shared_layers) attend with the keys and values an earlier layer
    of their type stored in `shared_kv_states`: the consumers' gradient reaches the storing layer's
    backward (model.side's shared entries). One step against transformers, every layer kept and
    the top two kept bitwise the run that recomputes them, greedy generation as transformers'."""
    model, store = store_of(tmp_path, "gemma4_text", 8, num_kv_shared_layers=2)  # a sliding and a full one
    assert model.config.kv_sharing_modes.count("reuse") == 2
    eng = make_engine(store)
    try:
        check_step_against_hf(eng, model.train())
    finally:
        eng.close()
    ref = run(store, "float32", 0, steps=2)
    assert_same(ref, run(store, "float32", store.arch.n_layers, steps=2))
    assert_same(ref, run(store, "float32", 2, steps=2))
    model.eval()
    items = prompts(model.config.vocab_size, seed=5)
    want = [hf_greedy(model, ids, 6, []) for ids in items]
    assert generate(store, items, Sampler(), host=False, eos=[], new=6) == want
