"""attend.causal_rows (a query tile's causal rows on the CPU, in pieces ending on the kernel's key
blocks, each with a Toeplitz mask view) against SDPA over the whole sequence: the tile's rows
and, summed over the tiles, every gradient."""

import pytest
import torch
import torch.nn.functional as F

from horizon_cli.model.attend import _toeplitz, causal_rows, dense_mask


@pytest.mark.parametrize(
    "T,tile,window,heads,kv_heads",
    [
        (1300, 700, None, 4, 2),  # pieces cut at the key block inside a tile; grouped K/V
        (1100, 512, None, 2, 2),  # tiles on the key blocks
        (1200, 300, 200, 2, 1),  # a window shorter than the tile
        (1100, 250, 600, 2, 2),  # a window longer than the tile, shorter than the row
        (300, 64, 37, 2, 1),  # all in the first key block
    ],
)
def test_tiles_of_causal_rows_equal_the_whole_sequence(T, tile, window, heads, kv_heads):
    g = torch.Generator().manual_seed(T + tile)
    q, k, v, dy = (torch.randn(1, n, T, 16, generator=g) for n in (heads, kv_heads, kv_heads, heads))
    whole = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(
        *whole, attn_mask=dense_mask(None, window, 1, T, "cpu"), scale=0.25, enable_gqa=heads != kv_heads
    )
    ref.backward(dy)
    out, dq, dk, dv = torch.empty_like(q), torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for s in range(0, T, tile):
        e = min(T, s + tile)
        lo = 0 if window is None else max(0, s - window + 1)
        qt, kt, vt = (t.clone().requires_grad_(True) for t in (q[:, :, s:e], k[:, :, lo:e], v[:, :, lo:e]))
        o = causal_rows(qt, kt, vt, s, window, 0.25)
        o.backward(dy[:, :, s:e])
        out[:, :, s:e], dq[:, :, s:e] = o.detach(), qt.grad
        dk[:, :, lo:e] += kt.grad
        dv[:, :, lo:e] += vt.grad
    for got, want in zip((out, dq, dk, dv), (ref.detach(), *(t.grad for t in whole)), strict=True):
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_the_toeplitz_mask_is_a_vector_read_as_the_rows():
    """The mask of 5 reversed queries over 9 keys, window 4: the rows of dense_mask, from a vector
    of 5 + 9 - 1 elements."""
    m = _toeplitz(5, 9, 4, torch.float32)
    assert m.untyped_storage().nbytes() == (5 + 9 - 1) * 4
    want = dense_mask(None, 4, 1, 9, "cpu")[0, 0, 4:9].flip(0)  # the last 5 queries, reversed
    assert torch.equal(m[0, 0] == 0, want)
