"""Twenty optimizer steps on the generic path against a resident transformers model + torch AdamW.

Micro-batching (2 per step), right padding, masked prompt tokens, weight decay and clipping; the
MoE families with their auxiliary loss on (and Mixtral off); weights, frozen buffers included
(DeepSeek-V3's routing bias must not move), within 1e-5 of the reference after 20 steps.
"""

import pytest

from tests.engine.test_engine_training import HP, batches, run_engine, step_at_depths
from tests.support.oracle import (
    engine_weights,
    hf_train_hp,
    make_engine,
    make_store,
    one_thread,  # noqa: F401 (autouse fixture: tiny models on one thread)
    rel_err,
)

CASES = [
    ("gemma2", True, False),
    ("gemma3", False, False),
    ("phi3", True, False),
    ("olmo2", False, False),
    ("mixtral", False, True),
    ("mixtral", True, False),
    ("qwen2_moe", True, True),
    ("qwen3_moe", False, True),
    ("gpt_oss", True, True),
    ("deepseek_v3", False, False),
]


@pytest.mark.parametrize(
    "family,tie,aux",
    CASES,
    ids=[f"{f}-{'tied' if t else 'untied'}{'-aux' if a else ''}" for f, t, a in CASES],
)
def test_twenty_steps_match_resident_adamw(tmp_path, family, tie, aux):
    model, store = make_store(tmp_path, family, tie, **({"output_router_logits": True} if aux else {}))
    data = batches(model.config.vocab_size, micro=2)
    eng = make_engine(store, **HP)
    try:
        res = run_engine(eng, data, HP["lr"])
        ref = hf_train_hp(model, data, HP)
        assert any(r.grad_norm > HP["grad_clip"] for r in res), "clipping must be exercised"
        assert all(r.weight_loads == 2 * store.arch.n_layers for r in res)
        for r, l_ref in zip(res, ref, strict=True):
            assert abs(r.loss - l_ref) / l_ref < 1e-5
        if aux:
            assert all(r.aux_loss is not None and r.expert_imbalance for r in res)
        ours = engine_weights(eng)
        theirs = dict(model.state_dict())
        if store.arch.tie_embeddings:
            theirs.pop("lm_head.weight")
        assert set(ours) == set(theirs)
        for name, p in theirs.items():
            assert rel_err(ours[name], p.detach()) < 1e-5, name
    finally:
        eng.close()


def test_device_peak_does_not_grow_with_depth(tmp_path):
    """A MoE model 2 and 8 layers deep: two loads per layer, the same device peak."""
    res = step_at_depths(tmp_path, "qwen3_moe", (2, 8))
    for layers, r in res.items():
        assert r.weight_loads == 2 * layers and len(r.expert_imbalance) == layers
    assert abs(res[8].device_peak_bytes - res[2].device_peak_bytes) / res[2].device_peak_bytes < 0.05
