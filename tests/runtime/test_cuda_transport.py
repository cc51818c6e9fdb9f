"""The CUDA transport's own logic, on the CPU, through a fake CUDA (tests/support/fake_cuda.py).

The fake runs the real engine/cuda.py: its streams, events, registrations and worker threads.
Numbers must come out bitwise equal to the CPU transport's, and the fake must see no stream
access out of order, no CUDA call on a thread whose current device is not the transport's, no
kernel launched with a pending error, and every registered buffer unregistered exactly once.
"""

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.errors import HorizonError
from horizon_cli.runtime.cuda import CudaTransport
from horizon_cli.runtime.trace import Tracer
from tests.support.fake_cuda import FakeCuda
from tests.support.oracle import engine_weights, make_store, micro_batches, random_rows

VOCAB = 96


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    out = {}
    for dtype, tie in (("bfloat16", True), ("float32", False)):
        _, out[dtype] = make_store(
            tmp_path_factory.mktemp(dtype), "llama", tie, dtype=dtype, num_hidden_layers=3
        )
    return out


def cuda(fake: FakeCuda, tracer=None) -> CudaTransport:
    return CudaTransport(torch.device("cuda", fake.index), tracer=tracer, api=fake)


def train(store, dtype, transport=None, prefetch=2, steps=3, tracer=None, max_tokens=0, lengths=(6, 24)):
    ecfg = EngineConfig(device="cpu", dtype=dtype, loss_chunk=16, prefetch=prefetch)
    eng = Engine(
        store, ecfg, OptimConfig(kernel="torch"), transport=transport, tracer=tracer, max_tokens=max_tokens
    )
    rows = random_rows(4 * steps + 4, VOCAB, seed=3, lo=lengths[0], hi=lengths[1])
    try:
        losses = [eng.step(micro_batches(rows[4 * s : 4 * s + 4], 2), 1e-3).loss for s in range(steps)]
        ev = eng.eval_loss(micro_batches(rows[-4:], 2))
        logits = eng.logits(micro_batches(rows[-2:], 2)[0])
    finally:
        eng.close()
    return losses, ev, logits, engine_weights(eng)


@pytest.mark.parametrize("dtype,prefetch", [("bfloat16", 2), ("float32", 3)])
def test_cuda_transport_trains_exactly_as_the_cpu_one_with_streams_in_order(stores, dtype, prefetch):
    """Includes the copy of the embedding rows into a freshly allocated buffer, which must wait for
    the compute issued before it (the caching allocator may hand out a block queued kernels read)."""
    fake = FakeCuda(index=1)
    tracer = Tracer(enabled=True)
    with fake.watching():
        got = train(stores[dtype], dtype, cuda(fake, tracer), prefetch, steps=2, tracer=tracer)
    want = train(stores[dtype], dtype, prefetch=prefetch, steps=2)
    assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])
    assert all(torch.equal(got[3][k], want[3][k]) for k in want[3])
    assert fake.problems == []  # stream order, current device of every thread, error state
    # every registered buffer unregistered exactly once, nothing left pinned
    assert fake.registrations > 0 and not fake.registered
    assert sum(fake.unregistered.values()) == fake.registrations
    # the main thread waits on the host only for what it reads there: the embedding's input grad
    # (and, tied, the LM head's grad), once per step, however many layers, plus the profiling
    # clock's anchor; every other dependency is a stream wait
    tied = stores[dtype].arch.tie_embeddings
    assert fake.host_waits["MainThread"] == 2 * (1 + tied + 1)
    assert {"h2d", "d2h", "compute"} <= {s.lane for s in tracer.spans}


def test_a_failed_registration_falls_back_to_pinned_memory_and_clears_the_error(stores):
    fake = FakeCuda(fail_register=lambda nbytes: nbytes % 3 == 0)
    t = cuda(fake)
    with fake.watching():
        got = train(stores["bfloat16"], "bfloat16", t, steps=2)
    assert t.fallbacks > 0 and fake.pinned == t.fallbacks
    assert fake.problems == []  # no kernel launched with cudaHostRegister's error still set
    want = train(stores["bfloat16"], "bfloat16", steps=2)
    assert got[0] == want[0]


def test_host_buffers_get_pages_of_their_own():
    """cudaHostRegister pins whole pages: small buffers from the heap would share pages and all
    but the first registration would fail."""
    fake = FakeCuda()
    t = cuda(fake)
    bufs = [t.host_empty(n, torch.bfloat16) for n in (3, 100, 1000, 5, 4097, 7) * 8]
    assert fake.registrations == len(bufs) and t.fallbacks == 0
    t.close()


def test_unregister_happens_once_and_is_checked():
    fake = FakeCuda()
    t = cuda(fake)
    a, b = t.host_empty(1000, torch.float32), t.host_empty(1000, torch.float32)
    t.host_release(a)
    t.host_release(a)  # a second release does nothing
    assert fake.unregistered[a.data_ptr()] == 1
    fake.registered.pop(b.data_ptr())  # CUDA no longer knows b: unregistering it fails
    with pytest.raises(HorizonError, match="cudaHostUnregister failed"):
        t.close()
    assert fake.last_error(clear=False) == 0  # and the error state was cleared


def test_without_a_way_to_clear_errors_nothing_is_registered():
    fake = FakeCuda(can_clear=False)
    t = cuda(fake)
    t.host_empty(1000, torch.float32)
    assert fake.registrations == 0 and fake.pinned == 1
    t.close()


def test_saved_input_buffers_are_sized_once(stores):
    """With the step's capacity known, lengths that grow from step to step re-pin nothing."""
    fake = FakeCuda()
    t = cuda(fake)
    max_tokens = 4 * 24
    eng = Engine(
        stores["float32"],
        EngineConfig(device="cpu", dtype="float32", loss_chunk=16),
        OptimConfig(kernel="torch"),
        transport=t,
        max_tokens=max_tokens,
    )
    pinned = fake.registrations
    for s, hi in enumerate((8, 16, 25)):  # the longest row grows every step, up to 24
        rows = random_rows(4, VOCAB, seed=s, lo=hi - 1, hi=hi)
        eng.step(micro_batches(rows, 2), 1e-3)
    assert fake.registrations == pinned and not fake.unregistered
    eng.close()


def test_an_error_that_will_not_clear_is_reported():
    fake = FakeCuda(fail_register=lambda nbytes: True)
    fake.last_error = lambda clear: 712  # cudaGetLastError does not reset it
    t = cuda(fake)
    with pytest.raises(HorizonError, match="CUDA error state not clean after a failed cudaHostRegister"):
        t.host_empty(1000, torch.float32)
    assert t.host_empty(0, torch.float32).numel() == 0
    t.close()


def test_after_a_sticky_cuda_error_close_raises_nothing_new(stores):
    """The error that stopped the engine is the one the user sees, even when the device keeps
    failing afterwards (a sticky error makes every later synchronize raise it again)."""
    from tests.engine.test_engine_robust import fail_at

    fake = FakeCuda()
    t = cuda(fake)
    eng = Engine(
        stores["float32"],
        EngineConfig(device="cpu", dtype="float32", prefetch=3),
        OptimConfig(kernel="torch"),
        transport=t,
    )
    illegal = RuntimeError("CUDA error: an illegal memory access was encountered")
    fail_at(t, "fwd 1", illegal)

    def sync():
        raise illegal

    fake.synchronize = sync
    with pytest.raises(RuntimeError, match="illegal memory access"):
        eng.step(micro_batches(random_rows(4, VOCAB), 2), 1e-3)
    eng.close()
    assert all(p._shutdown for p in t._pools.values())
