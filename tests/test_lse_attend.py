"""model.lse_attend: a causal query tile's attention as two unmasked pieces joined by their
log-sum-exp equals SDPA's causal attention over the whole range, forward and q/k/v gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from horizon_cli.model.lse_attend import causal_tile


@pytest.mark.parametrize(
    ("T", "lo", "s", "e", "heads", "kv_heads"),
    [
        (24, 0, 8, 16, 4, 4),
        (24, 0, 16, 24, 4, 2),
        (30, 5, 12, 19, 6, 2),
        (17, 0, 1, 17, 2, 1),
        (40, 3, 36, 40, 4, 1),
    ],
)
def test_joined_equals_causal_sdpa(T, lo, s, e, heads, kv_heads):
    g = torch.Generator().manual_seed(T + s)
    hd, scale = 16, 16**-0.5
    q = torch.randn(1, heads, T, hd, generator=g)
    k = torch.randn(1, kv_heads, T, hd, generator=g)
    v = torch.randn(1, kv_heads, T, hd, generator=g)
    dy = torch.randn(1, heads, e - s, hd, generator=g)

    # the oracle: SDPA causal over keys [lo, T), the tile's query rows [s, e) read off
    qa, ka, va = (t[:, :, lo:].clone().requires_grad_(True) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(
        qa, ka, va, is_causal=True, scale=scale, enable_gqa=heads != kv_heads
    )
    ref = ref[:, :, s - lo : e - lo]
    rq, rk, rv = torch.autograd.grad(ref, [qa, ka, va], dy)

    qt = q[:, :, s:e].clone().requires_grad_(True)
    kt, vt = (t[:, :, lo:e].clone().requires_grad_(True) for t in (k, v))
    out = causal_tile(qt, kt, vt, scale)
    dq, dk, dv = torch.autograd.grad(out, [qt, kt, vt], dy)

    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(dq, rq[:, :, s - lo : e - lo], atol=1e-6, rtol=0)
    torch.testing.assert_close(dk, rk[:, :, : e - lo], atol=1e-6, rtol=0)
    torch.testing.assert_close(dv, rv[:, :, : e - lo], atol=1e-6, rtol=0)
