"""model.fused (HORIZON_FUSED=1 on CUDA, off by default): RMSNorm, RoPE's rotation and SwiGLU
compiled by inductor, here on the CPU backend, against model/layer.py's eager functions, forward
and backward, at two shapes (one compile: dynamic shapes)."""

from __future__ import annotations

import pytest
import torch

from horizon_cli.model import fused, layer


def grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs[:-1]] + [xs[-1]]
    out = fn(*xs)
    seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    out.backward(seed)
    return out.detach(), [x.grad for x in xs[:-1]]


def inputs(name: str, T: int):
    g = torch.Generator().manual_seed(T)
    if name == "rms_norm":
        return torch.randn(2, T, 64, generator=g) * 3, torch.randn(64, generator=g), 1e-6
    if name == "swiglu":
        return torch.randn(2, T, 96, generator=g), torch.randn(2, T, 96, generator=g), None
    cos, sin = layer.rope_tables(torch.rand(8, generator=g), torch.arange(T).expand(2, T), torch.float32)
    return torch.randn(2, 4, T, 16, generator=g), cos, sin


FNS = {"rms_norm": layer.eager_rms_norm, "swiglu": layer.eager_swiglu, "rope": layer.eager_rope}


@pytest.mark.parametrize("name", list(FNS))
def test_compiled_equals_eager_forward_and_backward(name):
    eager = FNS[name]
    fn = (lambda a, b, _: eager(a, b)) if name == "swiglu" else eager
    for T in (24, 40):
        args = inputs(name, T)
        if name == "rope":  # (x, cos, sin): every argument a tensor, cos/sin without gradients
            ref = grads(lambda x, c, s: eager(x, c, s), *args[:1], args[1], args[2])
            got = grads(lambda x, c, s: fused.compiled(eager)(x, c, s), *args[:1], args[1], args[2])
        else:
            ref = grads(fn, *args)
            got = grads(lambda a, b, c: fused.compiled(fn)(a, b, c), *args)
        assert (got[0] - ref[0]).abs().max() <= 1e-5 * ref[0].abs().max()
        for a, b in zip(got[1], ref[1], strict=True):
            if b is not None:
                assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_off_by_default_and_on_the_cpu(monkeypatch):
    x = torch.ones(3)
    assert not fused.enabled(x)
    monkeypatch.setenv(fused.ENV, "1")
    assert not fused.enabled(x)  # CUDA tensors only
