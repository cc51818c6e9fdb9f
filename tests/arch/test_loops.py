"""Layers run in a loop (arch.calls): Dory calls its recurrent layers once per loop, and starts each
loop from transformers' own code between the calls (norm(h) + the input section's normalised
output). The streamed engine runs the sequence of calls — 2 loads per call, each unit's gradient
summed over its calls — against a resident transformers model + torch AdamW; the combinations it
does not run are refused by name."""

import pytest
import torch
import transformers

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.convert import convert
from horizon_cli.engine import Engine
from horizon_cli.errors import InputError
from horizon_cli.store import Store
from tests.support.oracle import (
    engine_weights,
    hf_train,
    micro_batches,
    one_thread,  # noqa: F401 (autouse fixture: tiny models on one thread)
    random_rows,
    rel_err,
)
from tests.support.tiny import save

# 1 input layer, 2 recurrent layers run twice, 1 output layer: calls 0 1 2 1 2 3
DORY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_hidden_layers=4, n_input_layers=1, n_recurrent_layers=2, n_output_layers=1,
    n_recurrent_loops=2, sliding_window=32,
)  # fmt: skip
CALLS = [0, 1, 2, 1, 2, 3]
HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, grad_clip=1.0)


def dory(tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.DoryConfig(**DORY)).float().eval()
    with torch.no_grad():  # the learned rates and scales away from their constant init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save(model, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    return model, Store.open(tmp_path / "store")


def engine(store, link: float = 0.0, keep: int = 0) -> Engine:
    cfg = EngineConfig(device="cpu", dtype="float32", loss_chunk=16, link_gbps=link)
    opt = {k: list(v) if isinstance(v, tuple) else v for k, v in HP.items()}
    return Engine(store, cfg, OptimConfig(kernel="torch", **opt), keep=keep)


@pytest.mark.parametrize("link", [0.0, 1e6], ids=["host-memory", "link"])
def test_dory_two_steps_match_transformers(tmp_path, link):
    """Host memory lent (the sums in the host gradients) and over an emulated link (the device's
    own fp32 sums per looped unit): losses and every weight after two steps, 2 loads per call."""
    model, store = dory(tmp_path)
    assert store.arch.generic["model"]["calls"] == CALLS
    assert store.arch.generic["model"]["junctions"] == {"1": [0], "3": [0, 2]}  # loop starts
    data = [micro_batches(random_rows(4, 128, seed=s, lo=10, hi=24), 2) for s in range(2)]
    eng = engine(store, link)
    try:
        res = [eng.step(mbs, HP["lr"]) for mbs in data]
        eng.wait()
        ref = hf_train(model, data, HP["lr"], HP["betas"], HP["eps"], HP["weight_decay"], HP["grad_clip"])
        assert [r.weight_loads for r in res] == [2 * len(CALLS)] * 2
        for r, l_ref in zip(res, ref, strict=True):
            assert abs(r.loss - l_ref) / l_ref < 1e-6
        ours = engine_weights(eng)
        for name, p in model.state_dict().items():
            assert rel_err(ours[name], p) < 1e-5, name
        ids = data[0][0]
        assert rel_err(eng.logits(ids), model(input_ids=ids.input_ids).logits.detach()) < 1e-5
    finally:
        eng.close()


def test_loop_refusals(tmp_path):
    """Kept layers with a loop: refused by name; a loop whose code between calls has trained
    weights (Inkling2-Loop's message passing): refused at convert."""
    _, store = dory(tmp_path)
    with pytest.raises(InputError, match="keep_activations: 2: .*loop .*6 calls for 4 layers.*not supported"):
        engine(store, keep=2)
    from horizon_cli.arch.generic import generic_spec
    from tests.support.census_config import tiny_config

    with pytest.raises(
        InputError, match="message_input, which has trained weights, between the calls of its loop"
    ):
        generic_spec(tiny_config("inkling2_loop_text", 6).to_dict(), "config.json")


def test_dory_lora_matches_peft(tmp_path):
    """LoRA on a loop: each adapter's gradient summed over its layer's calls, as PEFT's."""
    peft = pytest.importorskip("peft")
    from tests.lora.test_lora_engine import HP as LHP
    from tests.lora.test_lora_engine import batches, lora_engine, peft_model

    model, store = dory(tmp_path)
    pm = peft_model(model, ["q_proj", "down_proj"])
    pm.save_pretrained(tmp_path / "init")
    data = batches(128, steps=2)
    eng = lora_engine(store, tmp_path / "init", ["q_proj", "down_proj"])
    try:
        res = [eng.step(mbs, LHP["lr"]) for mbs in data]
        eng.wait()
        ref = hf_train(
            pm, data, LHP["lr"], tuple(LHP["betas"]), LHP["eps"], LHP["weight_decay"], LHP["grad_clip"]
        )
        assert [r.weight_loads for r in res] == [2 * len(CALLS)] * 2
        for r, l_ref in zip(res, ref, strict=True):
            assert abs(r.loss - l_ref) / l_ref < 1e-6
        ours, theirs = eng.host.tensors(), peft.get_peft_model_state_dict(pm)
        for k in theirs:
            assert rel_err(ours[k], theirs[k]) < 1e-5, k
    finally:
        eng.close()


def test_dory_generates_as_transformers(tmp_path, monkeypatch):
    """Greedy generation, the cache on the device: each loop's calls write the cache layers
    transformers gives them (its per-loop copies, `cache_offset` in the recorded arguments)."""
    from horizon_cli.generate import decoder as loop
    from horizon_cli.model.sample import Sampler
    from tests.generate.test_generate import hf_greedy, prompts, run

    monkeypatch.setattr(loop, "MICRO_TOKENS", 24)
    model, store = dory(tmp_path)
    items = prompts(128, seed=3)
    want = [hf_greedy(model, ids, 8, None) for ids in items]
    assert run(store, items, Sampler(), new=8) == want


def test_dory_host_kv_cache_refused(tmp_path):
    from horizon_cli.model.sample import Sampler
    from tests.generate.test_generate import prompts, run

    _, store = dory(tmp_path)
    with pytest.raises(InputError, match="kv_cache: host: .* loop"):
        run(store, prompts(128), Sampler(), host=True, new=2)


def test_inspect_and_dry_run_count_the_calls(tmp_path):
    """`horizon inspect` names the loop; the plan saves every call's input and counts 2 loads a call."""
    import io

    from rich.console import Console

    from horizon_cli import api
    from horizon_cli.planning.memory import memory_plan

    _, store = dory(tmp_path)
    out = io.StringIO()
    api.inspect(tmp_path / "store", console=Console(file=out, width=300))
    assert "layers run in a loop" in out.getvalue() and "6 calls: 0 1 2 1 2 3" in out.getvalue()
    plan = memory_plan(store.arch, "float32", batch=2, micro_batch=1, seq=16)
    acts = 2 * 16 * 64 * 4
    assert plan.calls == 6 and plan.loop and plan.kept_layer == (0, 0)
    assert plan.host["saved activations"] == 6 * acts
    assert plan.device["outputs held for the loop's junctions"] == acts  # call 0's, read by call 3


def test_dory_bf16_over_a_link_equals_host_memory_lent(tmp_path):
    """bf16 weights and gradients: the looped units' fp32 sums narrowed through the wire buffers
    over an emulated link give the model that host memory lent gives, bit for bit."""
    dory(tmp_path)
    convert(tmp_path / "hf", tmp_path / "bf16", dtype="bfloat16")
    store = Store.open(tmp_path / "bf16")
    data = [micro_batches(random_rows(4, 128, seed=s, lo=10, hi=24), 2) for s in range(2)]
    got = []
    for link in (0.0, 1e6):
        cfg = EngineConfig(device="cpu", dtype="bfloat16", loss_chunk=16, link_gbps=link)
        opt = {k: list(v) if isinstance(v, tuple) else v for k, v in HP.items()}
        eng = Engine(store, cfg, OptimConfig(kernel="torch", **opt))
        try:
            res = [eng.step(mbs, HP["lr"]) for mbs in data]
            eng.wait()
            got.append(([(r.loss, r.grad_norm, r.weight_loads) for r in res], engine_weights(eng)))
        finally:
            eng.close()
    (lent, w0), (linked, w1) = got
    assert lent == linked and all(r[2] == 2 * len(CALLS) for r in lent)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
