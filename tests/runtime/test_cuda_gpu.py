"""The CUDA-only logic on a real GPU (opt-in: `pytest -m gpu`, run by scripts/gpu_check.sh).

The same properties tests/runtime/test_cuda_transport.py checks through a fake CUDA, here against the
real runtime: a failed host registration leaves no error for the next kernel, buffers unregister
once and cleanly, the transport trains exactly like the CPU one in fp32, flex block masks match
dense masks forward and backward, the device fit check reads the real free memory, and the
native layer in sequence tiles (engine.seq_tile) gives the untiled layer's output and gradients
within the plan's layer working set (not yet run on a GPU: written without one).
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
    from horizon_cli.config.schema import EngineConfig, OptimConfig
    from horizon_cli.engine import Engine
    from horizon_cli.runtime.cuda import CudaTransport
    from tests.support.oracle import make_store, micro_batches, random_rows

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
    from horizon_cli.model.layer import inv_freq, layer_forward
    from horizon_cli.model.masks import attn_context
    from tests.model.test_attention import rows_batch, spec, weights

    sp = spec(window)
    T = 40
    mb = rows_batch(packed)
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


def tiled_against_untiled(device: str, packed: bool, window: int | None, tile: int = 9):
    """One native layer (GQA, test_attention's spec) on `device`: its output and every gradient
    tiled by `tile` (engine.seq_tile: masks as their rule, per-query-tile attention; the backward's
    deferred recompute, seeded with dy) against untiled (the default masks: flex's block masks on
    CUDA). Returns the largest error relative to each tensor's largest element."""
    from horizon_cli.model.call import LayerCall
    from horizon_cli.model.layer import inv_freq, layer_forward
    from horizon_cli.model.masks import attn_context
    from tests.model.test_attention import T, rows_batch, spec, weights

    sp = spec(window)
    mb = rows_batch(packed)
    inv = inv_freq(sp).to(device)
    w = {k: v.to(device).requires_grad_(True) for k, v in weights(sp).items()}
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, T, sp.hidden, generator=g).to(device).requires_grad_(True)
    dy = torch.randn(2, T, sp.hidden, generator=g).to(device)
    out = []
    for t in (0, tile):
        ctx = attn_context(mb, sp, inv, torch.float32, device, rows=t > 0)
        with torch.no_grad():
            y = layer_forward(w, x, ctx, sp, window, LayerCall(tile=t))
        r = layer_forward(w, x, ctx, sp, window, LayerCall(tile=t, deferred=True))  # the backward's recompute
        out.append((y, torch.autograd.grad(r, [x, *w.values()], dy)))
    (y0, g0), (y1, g1) = out
    errs = [((y1 - y0).abs().max() / y0.abs().max()).item()]
    errs += [
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() for a, b in zip(g1, g0, strict=True)
    ]
    return max(errs)


@pytest.mark.parametrize("packed,window", [(False, None), (True, None), (False, 16), (True, 16)])
def test_tiled_layers_give_the_untiled_layers_output_and_gradients(packed, window):
    """The native layer in query tiles on CUDA (SDPA per tile with its mask rows, grouped K/V
    repeated per head) against the whole-sequence kernels (flash; flex block masks)."""
    assert tiled_against_untiled("cuda", packed, window) <= 1e-3


def test_a_tiled_layers_device_peak_is_within_the_plan():
    """One native layer at 8,192 tokens (hidden 256, 4 heads of 64, one K/V head, intermediate
    2,048), its forward without autograd and the deferred recompute + backward as the engine
    runs them: the device's peak above what it held before, untiled and in tiles of 1,024, plain
    and packed (4 documents), within the plan's layer working set plus the weights' gradients
    (planning.memory.layer_work_bytes), the tiled peak below the untiled one."""
    from horizon_cli.arch import spec_from_hf
    from horizon_cli.data.batch import MicroBatch
    from horizon_cli.model.call import LayerCall
    from horizon_cli.model.layer import inv_freq, layer_forward
    from horizon_cli.model.masks import attn_context
    from horizon_cli.planning.memory import layer_work_bytes

    T = 8192
    hf = dict(model_type="llama", hidden_size=256, intermediate_size=2048, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=1, vocab_size=64, max_position_embeddings=T)  # fmt: skip
    sp = spec_from_hf(hf)
    H, inter, q, kv = sp.hidden, sp.intermediate, sp.q_dim, sp.kv_dim
    shapes = dict(wq=(q, H), wk=(kv, H), wv=(kv, H), wo=(H, q), w_gate=(inter, H), w_up=(inter, H),
                  w_down=(H, inter), attn_norm=(H,), mlp_norm=(H,))  # fmt: skip
    w = {k: (torch.randn(s, device="cuda") * 0.02).requires_grad_(True) for k, s in shapes.items()}
    grads = sum(p.numel() for p in w.values()) * 4
    inv = inv_freq(sp).cuda()
    x, dy = torch.randn(1, T, H, device="cuda"), torch.randn(1, T, H, device="cuda")
    peaks = {}
    for docs in (0, 4):
        doc = (torch.arange(T) * docs // T)[None].to(torch.int32) if docs else None
        pos = torch.arange(T)[None] if not docs else (torch.arange(T) % (T // docs))[None]
        ids = torch.zeros(1, T, dtype=torch.long)
        mb = MicroBatch(ids, ids, pos, doc, None)
        for tile in (0, 1024):
            for _ in range(2):  # the first run: the kernels' one-time allocations
                ctx = attn_context(mb, sp, inv, torch.float32, "cuda", rows=tile > 0)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                with torch.no_grad():
                    y = layer_forward(w, x, ctx, sp, None, LayerCall(tile=tile))
                del y
                xi = x.detach().requires_grad_(True)
                r = layer_forward(w, xi, ctx, sp, None, LayerCall(tile=tile, deferred=True))
                g = torch.autograd.grad([r], [xi, *w.values()], [dy])
                del r, g, xi, ctx
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
            plan = layer_work_bytes(sp, T, 1, T, 4, tile)
            peaks[docs, tile] = peak
            assert peak <= plan + grads, (docs, tile, peak, plan, grads)
        assert peaks[docs, 1024] < peaks[docs, 0], peaks
