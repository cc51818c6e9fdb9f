"""Whole optimizer steps: the streamed engine against a resident HF + torch.optim.AdamW run."""

import pytest
import torch

from tests.support.oracle import (
    engine_weights,
    hf_train_hp,
    make_engine,
    make_store,
    micro_batches,
    random_rows,
    rel_err,
)

STEPS = 20
# lr 3e-4: 20 steps move weights by up to ~30%; fp32 rounding in gradients, amplified by Adam's
# normalisation of near-zero gradients, stays below 1e-5 of the largest weight (it grows with lr).
HP = dict(lr=3e-4, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, grad_clip=0.5)


def batches(vocab, micro, steps=STEPS, batch=4, seed=0):
    rows = random_rows(steps * batch, vocab, seed=seed)
    return [micro_batches(rows[s * batch : (s + 1) * batch], micro) for s in range(steps)]


def run_engine(eng, steps_mbs, lr):
    out = []
    for mbs in steps_mbs:
        out.append(eng.step(mbs, lr))
    eng.wait()
    return out


@pytest.mark.parametrize("family,tie", [("llama", False), ("qwen2", True)])
def test_twenty_steps_match_resident_adamw(tmp_path, family, tie):
    model, store = make_store(tmp_path, family, tie)
    data = batches(model.config.vocab_size, micro=2)
    eng = make_engine(store, **HP)
    try:
        res = run_engine(eng, data, HP["lr"])
        ref = hf_train_hp(model, data, HP)
        assert any(r.grad_norm > HP["grad_clip"] for r in res), "clipping must be exercised"
        for r, l_ref in zip(res, ref, strict=True):
            assert abs(r.loss - l_ref) / l_ref < 1e-5
        ours = engine_weights(eng)
        for name, p in model.named_parameters():
            assert rel_err(ours[name], p.detach()) < 1e-5, name
    finally:
        eng.close()


def test_bf16_loss_within_one_percent_of_fp32(tmp_path):
    model, store = make_store(tmp_path, "llama", False)
    data = batches(model.config.vocab_size, micro=2)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        eng = make_engine(store, dtype=dtype, **HP)
        try:
            losses[dtype] = [r.loss for r in run_engine(eng, data, HP["lr"])]
        finally:
            eng.close()
    assert losses["float32"][-1] < losses["float32"][0]  # it learns
    assert abs(losses["bfloat16"][-1] - losses["float32"][-1]) / losses["float32"][-1] < 0.01


def test_micro_batch_size_does_not_change_the_update(tmp_path):
    model, store = make_store(tmp_path, "mistral", False)
    rows = random_rows(4, model.config.vocab_size, seed=3)
    results = {}
    for micro in (1, 2, 4):
        eng = make_engine(store, **HP)
        try:
            r = eng.step(micro_batches(rows, micro), HP["lr"])
            eng.wait()
            results[micro] = (r, engine_weights(eng))
        finally:
            eng.close()
    ref_r, ref_w = results[4]
    for micro in (1, 2):
        r, w = results[micro]
        assert r.weight_loads == ref_r.weight_loads == 2 * store.arch.n_layers
        assert abs(r.loss - ref_r.loss) / ref_r.loss < 1e-6
        for name in ref_w:
            assert rel_err(w[name], ref_w[name]) < 1e-5, name


def test_non_finite_step_leaves_the_store_untouched(tmp_path):
    model, store = make_store(tmp_path, "llama", False)
    eng = make_engine(store, **HP)
    mbs = micro_batches(random_rows(4, model.config.vocab_size), 2)
    try:
        before = {k: v.clone() for k, v in engine_weights(eng).items()}
        st = eng.host["layer.1"]
        st.stream[5] = float("nan")  # poison one weight: loss and gradients become non-finite
        r = eng.step(mbs, HP["lr"])
        eng.wait()
        assert r.skipped
        after = engine_weights(eng)
        for k in before:
            if k != "model.layers.1.input_layernorm.weight":
                assert torch.equal(before[k], after[k]), k
        assert eng.adam_step == 0
    finally:
        eng.close()


def step_at_depths(tmp_path, family: str, depths) -> dict:
    """One step of the same 4 rows (2 micro-batches) on `family` models `depths` layers deep:
    depth -> the step's StepResult."""
    out = {}
    for layers in depths:
        model, store = make_store(tmp_path / str(layers), family, False, num_hidden_layers=layers)
        eng = make_engine(store, **HP)
        try:
            out[layers] = eng.step(batches(model.config.vocab_size, micro=2, steps=1)[0], HP["lr"])
        finally:
            eng.close()
    return out


def test_device_peak_does_not_grow_with_depth(tmp_path):
    res = step_at_depths(tmp_path, "llama", (4, 32))
    for layers, r in res.items():
        assert r.weight_loads == 2 * layers
    assert abs(res[32].device_peak_bytes - res[4].device_peak_bytes) / res[4].device_peak_bytes < 0.05


@pytest.mark.parametrize("dtype,tie", [("float32", True), ("bfloat16", False)])
def test_lending_host_memory_equals_copying(tmp_path, dtype, tie):
    """On the CPU without an emulated link the loader lends host buffers instead of copying them;
    the result is bitwise that of the copying pipeline (an unthrottled link)."""
    from horizon_cli.config.schema import EngineConfig, OptimConfig
    from horizon_cli.engine import Engine

    model, store = make_store(tmp_path, "llama", tie, dtype=dtype)
    data = batches(model.config.vocab_size, micro=2, steps=3)
    out = {}
    for link in (0.0, 1e6):  # 0: lend; 1e6 GB/s: copy on the worker threads, no throttling
        eng = Engine(
            store, EngineConfig(device="cpu", dtype=dtype, link_gbps=link, loss_chunk=16), OptimConfig(**HP)
        )
        assert eng.t.shares_host == (link == 0)
        try:
            losses = [eng.step(mbs, HP["lr"]).loss for mbs in data]
            eng.wait()
            out[link] = (losses, engine_weights(eng))
        finally:
            eng.close()
    assert out[0.0][0] == out[1e6][0]
    for name, w in out[0.0][1].items():
        assert torch.equal(w, out[1e6][1][name]), name
