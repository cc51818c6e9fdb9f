"""Issue 42's defects where only a GPU can show them (opt-in: `pytest -m gpu`; scripts/gpu_check.sh
runs them). Written without a GPU: not yet run on one. tests/runtime/test_gpu_ready.py has the CPU halves."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_masked_grouped_query_call_runs_without_the_math_kernel():
    """Padded prefill / attention dropout: a bool mask with grouped K/V. With the math kernel
    disabled it still runs (K/V repeated, the memory-efficient kernel), and equals the math one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from horizon_cli.model import attend

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 32, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    doc = (torch.arange(1024, device="cuda") >= 300).int().expand(2, 1024)
    mask = attend.dense_mask(doc, None, 2, 1024, "cuda")
    with sdpa_kernel(
        [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    ):
        fused = attend.attend(q, k, v, mask, 128**-0.5)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=128**-0.5, enable_gqa=True
        )
    assert (fused.float() - ref.float()).abs().max() < 2e-2


def test_flex_compiles_once_across_lengths_and_never_falls_back():
    """Training-shaped calls at several lengths (not multiples of 128 too) compile a bounded number
    of times; the mask_mod reads no document id past T (compute-sanitizer would say; here the
    result matches the dense mask's)."""
    import torch._dynamo.utils as du

    from horizon_cli.model import attend

    du.counters.clear()
    for T in (1000, 2048, 1500, 4096):
        q = torch.randn(1, 32, T, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 8, T, 128, device="cuda", dtype=torch.bfloat16)
        doc = (torch.arange(T, device="cuda") >= T // 3).int()[None]
        out = attend.attend(q, k, k, attend.block_mask(doc, None, 1, T, "cuda"), 128**-0.5)
        out.float().sum().backward()
        dense = attend.attend(q.detach(), k, k, attend.dense_mask(doc, None, 1, T, "cuda"), 128**-0.5)
        assert (out.detach().float() - dense.float()).abs().max() < 2e-2
    # flex's own (grad mode; one or more blocks) and the compiled block masks' builders
    assert du.counters["stats"]["unique_graphs"] <= 8


def test_sumsq_is_one_launch_per_buffer_on_cuda():
    from horizon_cli.engine.grads import sumsq

    g = torch.randn(218_112_000, device="cuda")  # one Llama-3.1-8B layer
    pieces = sumsq(g)
    assert len(pieces) == 1
    exact = float(g.double().square().sum())
    assert abs(float(pieces[0]) - exact) / exact < 1e-10


def test_libcudart_is_the_one_torch_uses():
    """The library picked answers for torch's runtime: a failed cudaHostRegister's error, left by
    torch's cudart binding, is visible to (and cleared by) the picked library's cudaGetLastError."""
    from horizon_cli.runtime.cuda import TorchCuda

    api = TorchCuda(0)
    a = torch.empty(1 << 20).pin_memory()  # already pinned: registering it again fails
    err = api.host_register(a.data_ptr(), 4096)
    assert err != 0 and api.last_error(clear=True) == err and api.last_error(clear=False) == 0


def test_host_kv_generation_releases_no_buffer_under_a_copy(tmp_path):
    """The host KV cache against the device one, rows ending at different times (issue 42 item 1)."""
    from horizon_cli.config.schema import EngineConfig, OptimConfig
    from horizon_cli.engine import Engine
    from horizon_cli.generate.decoder import Decoder
    from horizon_cli.model.sample import Sampler
    from tests.support.oracle import make_store

    _, store = make_store(tmp_path, "llama", False, num_hidden_layers=4)
    items = [(i, list(range(3 + i, 3 + i + n))) for i, n in enumerate((3, 11, 7, 14, 5))]
    out = []
    for host in (False, True):
        eng = Engine(
            store,
            EngineConfig(device="cuda", dtype="float32"),
            OptimConfig(kernel="torch"),
            forward_only=True,
        )
        try:
            dec = Decoder(
                eng,
                Sampler(temperature=1.0, seed=4),
                max_new_tokens=12,
                eos_ids=list(range(3, 15)),
                host_kv=host,
            )
            out.append([c.ids for c in dec.run(items)])
        finally:
            eng.close()
    assert out[0] == out[1] and len({len(r) for r in out[0]}) > 1
