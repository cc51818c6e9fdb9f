"""The streaming engine against transformers: logits, loss and every gradient (fp32)."""

import pytest
import torch

from tests.support.oracle import (
    check_step_against_hf,
    make_engine,
    make_store,
    micro_batches,
    random_rows,
    rel_err,
)

CASES = [
    ("llama", False),
    ("llama", True),
    ("llama31", False),
    ("mistral", False),  # sliding window 8 < sequence lengths up to 24
    ("qwen2", True),
    ("qwen2", False),
    ("qwen3", False),
    ("qwen3", True),
]


@pytest.mark.parametrize("family,tie", CASES)
def test_logits_loss_and_grads_match_transformers(tmp_path, family, tie):
    model, store = make_store(tmp_path, family, tie)
    eng = make_engine(store)
    try:
        check_step_against_hf(eng, model)
    finally:
        eng.close()


def test_eval_loss_matches_training_loss(tmp_path):
    model, store = make_store(tmp_path, "qwen2", False)
    eng = make_engine(store)
    mbs = micro_batches(random_rows(4, model.config.vocab_size, seed=2), 2)
    try:
        loss_sum, tokens, _ = eng.forward_backward(mbs)
        ev_sum, ev_tokens = eng.eval_loss(mbs)
        assert ev_tokens == tokens
        assert abs(ev_sum - loss_sum) / loss_sum < 1e-6
    finally:
        eng.close()


def test_packed_rows_do_not_attend_across_documents(tmp_path):
    """A packed row of two documents gives each document the logits it has alone."""
    from horizon_cli.data.batch import IGNORE, MicroBatch

    model, store = make_store(tmp_path, "llama", False)
    eng = make_engine(store)
    a, b = torch.randint(0, 96, (7,)), torch.randint(0, 96, (9,))
    ids = torch.cat([a, b])[None]
    pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
    doc = torch.cat([torch.zeros(7), torch.ones(9)]).to(torch.int32)[None]
    packed = MicroBatch(ids, torch.full_like(ids, IGNORE), pos, doc)
    try:
        out = eng.logits(packed)[0]
        ref_a = model(input_ids=a[None]).logits[0].detach()
        ref_b = model(input_ids=b[None]).logits[0].detach()
        assert rel_err(out[:7], ref_a) < 1e-5
        assert rel_err(out[7:], ref_b) < 1e-5
    finally:
        eng.close()
