"""Attention kernels (engine/attend.py): the CUDA path's flex block masks give what the CPU's dense
masks give, and grouped-query K/V reach the kernel unexpanded."""

import pytest
import torch

from horizon_cli.arch import spec_from_hf
from horizon_cli.data.batch import MicroBatch
from horizon_cli.model import attend
from horizon_cli.model.call import LayerCall
from horizon_cli.model.layer import inv_freq, layer_forward
from horizon_cli.model.masks import attn_context
from tests.support.tiny import BASE

T = 40


def spec(window=None):
    cfg = dict(
        BASE, model_type="mistral" if window else "llama", num_attention_heads=4, num_key_value_heads=2
    )
    if window:
        cfg["sliding_window"] = window
    return spec_from_hf(cfg)


def weights(sp, seed=0):
    g = torch.Generator().manual_seed(seed)
    H, q, kv, inter = sp.hidden, sp.q_dim, sp.kv_dim, sp.intermediate
    shapes = dict(attn_norm=(H,), wq=(q, H), wk=(kv, H), wv=(kv, H), wo=(H, q), mlp_norm=(H,),
                  w_gate=(inter, H), w_up=(inter, H), w_down=(H, inter))  # fmt: skip
    return {k: torch.randn(s, generator=g) * (0.2 if len(s) > 1 else 1.0) for k, s in shapes.items()}


def packed_batch():
    doc = torch.zeros(2, T, dtype=torch.int32)
    doc[0, 11:], doc[0, 30:], doc[1, 25:] = 1, 2, 1  # documents of 11/19/10 and 25/15 tokens
    pos = torch.stack(
        [
            torch.cat([torch.arange(n) for n in torch.unique_consecutive(d, return_counts=True)[1]])
            for d in doc
        ]
    )
    ids = torch.zeros(2, T, dtype=torch.int64)
    return MicroBatch(ids, ids, pos, doc)


def rows_batch(packed: bool) -> MicroBatch:
    """Two rows of T tokens: packed_batch's documents, or one sequence each."""
    if packed:
        return packed_batch()
    return MicroBatch(*(torch.zeros(2, T, dtype=torch.int64),) * 2, torch.arange(T).expand(2, T))


@pytest.mark.filterwarnings("ignore:.*flex_attention")
@pytest.mark.parametrize("packed,window", [(True, None), (False, 7), (True, 7)])
def test_block_masks_give_what_dense_masks_give(packed, window):
    sp = spec(window)
    mb = rows_batch(packed)
    inv = inv_freq(sp)
    dense = attn_context(mb, sp, inv, torch.float32, "cpu", fused=False)
    block = attn_context(mb, sp, inv, torch.float32, "cpu", fused=True)
    assert isinstance(block.masks[window], attend.BlockMask) and dense.masks[window].dtype == torch.bool
    x = torch.randn(2, T, sp.hidden, generator=torch.Generator().manual_seed(1))
    w = weights(sp)
    with torch.no_grad():  # flex_attention has no backward on the CPU; on CUDA it runs compiled
        want = layer_forward(w, x, dense, sp, window)
        got = layer_forward(w, x, block, sp, window)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_plain_causal_attention_needs_no_mask():
    sp = spec()
    mb = rows_batch(False)
    assert attn_context(mb, sp, inv_freq(sp), torch.float32, "cpu").masks == {None: None}


@pytest.mark.parametrize("packed", [False, True])
def test_grouped_query_kv_reach_the_kernel_unexpanded(packed, monkeypatch):
    seen = []
    sdpa = attend.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[1], k.shape[1], v.shape[1], kw.get("enable_gqa")))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(attend.F, "scaled_dot_product_attention", spy)
    sp = spec()
    mb = rows_batch(packed)
    ctx = attn_context(mb, sp, inv_freq(sp), torch.float32, "cpu")
    x = torch.randn(2, T, sp.hidden).requires_grad_(True)
    y = layer_forward(weights(sp), x, ctx, sp, None)
    y.sum().backward()
    assert seen == [(sp.n_heads, sp.n_kv_heads, sp.n_kv_heads, True)]


@pytest.mark.parametrize("packed,window", [(True, None), (False, 7), (True, 7)])
def test_a_tiled_micro_batch_gets_the_masks_rule_where_flex_would_run(packed, window):
    """Where the layers run a micro-batch in tiles (engine.seq_tile), its masks are RowMasks on
    CUDA too (fused): flex's block mask would keep the tiled layer's attention whole and its
    projections untiled, which the tiled plan does not count. The tiled layer over them gives the
    untiled layer's output with dense masks."""
    sp = spec(window)
    mb = rows_batch(packed)
    inv = inv_freq(sp)
    rows = attn_context(mb, sp, inv, torch.float32, "cpu", fused=True, rows=True)
    assert isinstance(rows.masks[window], attend.RowMask)
    dense = attn_context(mb, sp, inv, torch.float32, "cpu", fused=False)
    x = torch.randn(2, T, sp.hidden, generator=torch.Generator().manual_seed(2))
    w = weights(sp)
    with torch.no_grad():
        want = layer_forward(w, x, dense, sp, window)
        got = layer_forward(w, x, rows, sp, window, LayerCall(tile=9))
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
