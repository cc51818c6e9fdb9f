"""The generic path (transformers' own decoder layers, streamed) against transformers, fp32.

For every generic family, tied and untied: logits, loss and every gradient within 1e-5 relative
of the resident HF model, and convert -> export writes the checkpoint's tensors back bitwise under
their on-disk names (per-expert tensors for Mixtral / Qwen-MoE / DeepSeek-V3, fused for gpt-oss).
MoE families with the auxiliary loss on: aux_loss, loss and gradients equal transformers' own
(ForCausalLM with output_router_logits), and the aux loss does not depend on the micro-batch split.
"""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from horizon_cli.export import export
from tests.support.oracle import (
    check_grads,
    check_step_against_hf,
    engine_grads,
    hf_loss_backward,
    make_engine,
    make_store,
    micro_batches,
    one_thread,  # noqa: F401 (autouse fixture: tiny models on one thread)
    random_rows,
    real_tokens,
    rel_err,
)
from tests.support.tiny import GENERIC

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"]  # families whose ForCausalLM adds an aux loss
CASES = [(f, tie) for f in GENERIC for tie in (False, True)]


def check_roundtrip(tmp: Path):
    """Every tensor of the source checkpoint comes back bitwise under its own name."""
    export(tmp / "store", tmp / "out")
    with safe_open(tmp / "hf" / "model.safetensors", "pt") as src:
        names = set(src.keys())
        out = {}
        for f in (tmp / "out").glob("*.safetensors"):
            with safe_open(f, "pt") as o:
                out.update({k: o.get_tensor(k) for k in o.keys()})  # noqa: SIM118 (safe_open is not iterable)
        assert set(out) == names
        for k in names:
            a, b = src.get_tensor(k), out[k]
            assert (
                a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
            ), k


@pytest.mark.parametrize("family,tie", CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def test_generic_matches_transformers(tmp_path, family, tie):
    model, store = make_store(tmp_path, family, tie)
    assert store.arch.path == "generic"
    eng = make_engine(store)
    try:
        check_step_against_hf(eng, model)
    finally:
        eng.close()
    check_roundtrip(tmp_path)


@pytest.mark.parametrize("family", MOE)
def test_aux_loss_matches_transformers(tmp_path, family):
    """One micro-batch = the global batch: transformers' ForCausalLM computes loss = CE + coef * aux
    itself (padding masked by the attention mask); ours must equal it, gradients included."""
    model, store = make_store(tmp_path, family, False, output_router_logits=True)
    eng = make_engine(store)
    (mb,) = micro_batches(random_rows(4, model.config.vocab_size, seed=4, lo=8, hi=20), 4)
    try:
        loss_sum, tokens, _ = eng.forward_backward([mb])
        aux, imbalance = eng.tmpl.step_stats()
        model.zero_grad()
        out = model(
            input_ids=mb.input_ids,
            attention_mask=real_tokens(mb),
            labels=mb.labels,
            output_router_logits=True,
        )
        out.loss.backward()
        assert abs(aux - out.aux_loss.item()) / out.aux_loss.item() < 1e-6
        total = loss_sum / tokens + model.router_aux_loss_coef * aux
        assert abs(total - out.loss.item()) / out.loss.item() < 1e-6
        check_grads(eng, model)
        assert len(imbalance) == len(store.arch.generic["moe"]["layers"]) and all(v >= 1.0 for v in imbalance)
    finally:
        eng.close()


def test_aux_loss_is_global_over_micro_batches(tmp_path):
    """Split into 1, 2 or 4 micro-batches, the step's aux loss and gradients are the same."""
    model, store = make_store(tmp_path, "qwen3_moe", True, output_router_logits=True)
    rows = random_rows(4, model.config.vocab_size, seed=5, lo=6, hi=20)
    runs = {}
    for micro in (1, 2, 4):
        eng = make_engine(store)
        try:
            eng.forward_backward(micro_batches(rows, micro))
            runs[micro] = (eng.tmpl.step_stats()[0], {k: v.clone() for k, v in engine_grads(eng).items()})
        finally:
            eng.close()
        if micro == 2:  # the oracle, split the same way
            model.zero_grad()
            hf_loss_backward(model, micro_batches(rows, micro))
            check_grads_against = {k: p.grad for k, p in model.named_parameters()}
            for k, g in runs[2][1].items():
                assert rel_err(g, check_grads_against[k]) < 1e-5, k
    for micro in (1, 2):
        assert abs(runs[micro][0] - runs[4][0]) / runs[4][0] < 1e-6
        for k, g in runs[micro][1].items():
            assert rel_err(g, runs[4][1][k]) < 1e-5, k


def test_packed_rows_do_not_attend_across_documents(tmp_path):
    """Packed documents, alternating sliding/full layers: each document gets its own logits."""
    from horizon_cli.data.batch import IGNORE, MicroBatch

    model, store = make_store(tmp_path, "gpt_oss", False)
    eng = make_engine(store)
    a, b = torch.randint(0, 96, (7,)), torch.randint(0, 96, (9,))
    ids = torch.cat([a, b])[None]
    pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
    doc = torch.cat([torch.zeros(7), torch.ones(9)]).to(torch.int32)[None]
    try:
        out = eng.logits(MicroBatch(ids, torch.full_like(ids, IGNORE), pos, doc))[0]
        assert rel_err(out[:7], model(input_ids=a[None]).logits[0].detach()) < 1e-5
        assert rel_err(out[7:], model(input_ids=b[None]).logits[0].detach()) < 1e-5
    finally:
        eng.close()
