"""The CUDA-only logic on a real GPU (opt-in: `pytest -m gpu`, run by scripts/gpu_check.sh).

The same properties tests/test_cuda_transport.py checks through a fake CUDA, here against the
real runtime: a failed host registration leaves no error for the next kernel, buffers unregister
once and cleanly, the transport trains exactly like the CPU one in fp32, flex block masks match
dense masks forward and backward, and the device fit check reads the real free memory.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_failed_registration_leaves_no_error_for_the_next_kernel():
    from horizon_cli.runtime.cuda import CudaTransport

    t = CudaTransport(torch.device("cuda", 0))
    assert t.register, "libcudart's error functions were not found: registration is off"
    a = t.host_empty(1 << 20, torch.float32)
    err = t.api.host_register(a.data_ptr(), 4096)  # the same pages again: CUDA refuses
    assert err != 0 and t.api.last_error(clear=False) == err  # the sticky last error is set
    t._clear_error(err, "cudaHostRegister")
    x = torch.ones(1 << 20, device="cuda")
    (x * 2).sum().item()  # a kernel launch: torch would raise the registration's error here
    torch.cuda.synchronize()
    t.host_release(a)
    t.host_release(a)
    t.close()


def test_fallback_to_pinned_memory_trains(tmp_path):
    from oracle import make_store, micro_batches, random_rows

    from horizon_cli.config.schema import EngineConfig, OptimConfig
    from horizon_cli.engine import Engine
    from horizon_cli.runtime.cuda import CudaTransport

    _, store = make_store(tmp_path, "llama", False)
    t = CudaTransport(torch.device("cuda", 0))
    real = t.api.host_register

    def failing(ptr, n):  # a real failure, with its sticky error: the same pages twice
        assert real(ptr, n) == 0
        err = real(ptr, n)
        assert t.api.host_unregister(ptr) == 0
        return err

    t.api.host_register = failing
    eng = Engine(
        store, EngineConfig(device="cuda", dtype="float32"), OptimConfig(kernel="torch"), transport=t
    )
    try:
        r = eng.step(micro_batches(random_rows(4, 96), 2), 1e-3)
        assert r.loss == r.loss
    finally:
        eng.close()


@pytest.mark.parametrize("packed,window", [(True, None), (False, 64), (True, 64)])
def test_flex_block_masks_match_dense_masks_forward_and_backward(packed, window):
    from test_attention import packed_batch, spec, weights

    from horizon_cli.data.batch import MicroBatch
    from horizon_cli.model.layer import inv_freq, layer_forward
    from horizon_cli.model.masks import attn_context

    sp = spec(window)
    T = 40
    mb = (
        packed_batch()
        if packed
        else MicroBatch(*(torch.zeros(2, T, dtype=torch.int64),) * 2, torch.arange(T).expand(2, T))
    )
    inv = inv_freq(sp).cuda()
    w = {k: v.cuda().requires_grad_(True) for k, v in weights(sp).items()}
    x = torch.randn(2, T, sp.hidden, device="cuda", requires_grad=True)
    out = []
    for fused in (False, True):
        ctx = attn_context(mb, sp, inv, torch.float32, "cuda", fused=fused)
        y = layer_forward(w, x, ctx, sp, window)
        grads = torch.autograd.grad(y.square().sum(), [x, *w.values()])
        out.append((y, grads))
    (y0, g0), (y1, g1) = out
    assert (y1 - y0).abs().max() <= 1e-3 * y0.abs().max()
    for a, b in zip(g0, g1, strict=True):
        assert (a - b).abs().max() <= 1e-3 * b.abs().max().clamp_min(1e-6)


def test_device_fit_reads_the_real_free_memory():
    from horizon_cli.config.schema import EngineConfig
    from horizon_cli.planning.fit import device_fit
    from horizon_cli.planning.memory import MemoryPlan

    ok, why = device_fit(MemoryPlan(1, device={"x": 1 << 20}), EngineConfig(device="cuda"))
    assert ok and "cuda:0 needs" in why
    big = MemoryPlan(1, device={"x": torch.cuda.get_device_properties(0).total_memory})
    assert not device_fit(big, EngineConfig(device="cuda"))[0]
