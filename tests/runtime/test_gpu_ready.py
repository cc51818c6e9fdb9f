"""Issue 42's defects of the CUDA path, each where the CPU can show it: the sums of squares in one
pass, the masked grouped-query kernel choice, flex_attention compiled for any length and its
mask_mod past T, the sharded totals' wait for the compute, libcudart's choice, the plan's
backward transients and the kept layers' margin. tests/runtime/test_cuda_gpu.py has the GPU halves."""

from __future__ import annotations

import threading

import pytest
import torch

from horizon_cli.arch import spec_from_hf
from horizon_cli.engine.grads import sumsq
from horizon_cli.model import attend
from horizon_cli.planning.fit import RESERVE, Machine
from horizon_cli.planning.keep import auto_keep
from horizon_cli.planning.memory import memory_plan
from horizon_cli.runtime.cuda import cudart_candidates
from horizon_cli.runtime.events import Event
from tests.planning.test_device_fit import LLAMA_8B

GiB = 1 << 30


def test_sumsq_in_one_pass_is_one_piece_and_exact():
    g = torch.randn(3_000_001, generator=torch.Generator().manual_seed(0))
    exact = float(g.double().square().sum())
    pieces = sumsq(g, one_pass=True)
    assert len(pieces) == 1 and pieces[0].dtype == torch.float64
    assert abs(float(pieces[0]) - exact) / exact < 1e-11  # the chunked fp32 dots: ~1e-7
    chunked = sumsq(g)  # the CPU's default: the chunked dots, as before (bitwise)
    assert len(chunked) == 12 and all(a.dtype == torch.float32 for a in chunked)
    assert torch.equal(torch.stack(chunked), torch.stack([torch.dot(c, c) for c in g.split(1 << 18)]))
    assert sumsq(torch.zeros(0), one_pass=True) == []


def test_a_masked_grouped_query_call_repeats_kv_on_cuda_only():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert attend.expands_kv(cuda, masked=True, gqa=True)
    assert not attend.expands_kv(cuda, masked=False, gqa=True)  # causal: flash takes the groups
    assert not attend.expands_kv(cuda, masked=True, gqa=False)
    assert not attend.expands_kv(cpu, masked=True, gqa=True)  # the CPU's kernel takes both


def test_repeated_kv_gives_the_grouped_result(monkeypatch):
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(2, 8, 40, 16, generator=g),
        torch.randn(2, 2, 40, 16, generator=g),
        torch.randn(2, 2, 40, 16, generator=g),
    )
    doc = (torch.arange(40) >= 13).int().expand(2, 40)
    mask = attend.dense_mask(doc, 9, 2, 40, "cpu")
    grouped = attend.attend(q, k, v, mask, 0.25)
    monkeypatch.setattr(attend, "expands_kv", lambda device, masked, gqa: masked and gqa)
    assert (attend.attend(q, k, v, mask, 0.25) - grouped).abs().max() < 1e-6


def test_flex_is_compiled_once_for_every_length():
    """Lengths of several blocks, a multiple of 128 or not, documents and a window: one compile
    (a compile per length ran into dynamo's recompile limit, and flex then ran eagerly). The
    heads (12, 6) differ from every block count here: dynamo gives equal sizes one symbol, so a
    block count equal to a head count is one more compile (attend.FLEX_RECOMPILES allows for it)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    count = CompileCounter()
    fn = attend.compile_flex(backend=count)
    for T in (256, 384, 200, 520):
        q, k = torch.randn(1, 12, T, 16), torch.randn(1, 6, T, 16)
        doc = (torch.arange(T) >= T // 3).int()[None]
        mask = attend.block_mask(doc, 64, 1, T, "cpu")
        out = fn(q, k, k, block_mask=mask, scale=0.25, enable_gqa=True)
        dense = attend.attend(q, k, k, attend.dense_mask(doc, 64, 1, T, "cpu"), 0.25)
        assert (out - dense).abs().max() < 1e-5
    assert count.frame_count == 1
    torch._dynamo.reset()


def test_mask_mod_is_safe_past_the_sequence():
    """flex's kernels evaluate mask_mod on whole 128-blocks: past T when T is not a multiple."""
    T = 200
    doc = (torch.arange(T) >= 70).int()[None]
    mod = attend.block_mask(doc, None, 1, T, "cpu").mask_mod
    b, h = torch.tensor(0), torch.tensor(0)
    assert not bool(mod(b, h, torch.tensor(255), torch.tensor(3)))  # a padded query: no document
    assert not bool(mod(b, h, torch.tensor(199), torch.tensor(240)))  # a padded key: never visible
    dense = attend.dense_mask(doc, None, 1, T, "cpu")[0, 0]
    for qi, ki in [(150, 80), (150, 60), (69, 0), (199, 199)]:
        assert bool(mod(b, h, torch.tensor(qi), torch.tensor(ki))) == bool(dense[qi, ki])


class Later(Event):
    """A compute event that completes only when waited on (the sharded totals must wait)."""

    def __init__(self):
        self.waited = threading.Event()

    def host_wait(self) -> None:
        self.waited.set()

    def done(self) -> bool:
        return self.waited.is_set()


def test_sharded_totals_read_the_loss_only_after_the_compute():
    from horizon_cli.engine.sharded import ShardedGrads
    from horizon_cli.parallel.comm import Dist
    from horizon_cli.runtime.transport import CpuTransport

    class Host:
        units: dict = {}

    t = CpuTransport()
    ev = Later()
    t.record = lambda: ev  # type: ignore[method-assign]
    d = Dist(world=1, rank=0)
    sg = ShardedGrads(d, t, Host(), torch.float32)  # type: ignore[arg-type]
    seen = []
    try:
        out = sg.sum_all(lambda: seen.append(ev.waited.is_set()) or [1.0, 2.0])
    finally:
        d.stop()
        t.close()
    assert out == [1.0, 2.0] and seen == [True]


def test_libcudart_is_torchs_own():
    torch_dir = "/venv/lib/python3.11/site-packages/torch"
    mapped = {
        "/opt/conda/lib/libcudart.so.11.0",
        "/usr/local/cuda-12.1/lib64/libcudart.so.12",
        "/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12",
    }
    assert cudart_candidates(mapped, torch_dir, "12.8")[0].endswith("nvidia/cuda_runtime/lib/libcudart.so.12")
    bundled = mapped | {torch_dir + "/lib/libcudart-9335f6a2.so.12"}
    assert cudart_candidates(bundled, torch_dir, "12.8")[0] == torch_dir + "/lib/libcudart-9335f6a2.so.12"
    system = {"/opt/conda/lib/libcudart.so.11.0", "/usr/lib/x86_64-linux-gnu/libcudart.so.12"}
    assert cudart_candidates(system, torch_dir, "12.8")[0] == "/usr/lib/x86_64-linux-gnu/libcudart.so.12"


@pytest.mark.parametrize("seq", [8192, 65536])
def test_the_plan_counts_the_backwards_transients(seq):
    """Llama-3.1-8B, bf16: a layer's weight gradients at once (436 MB), flash's fp32 dQ and the
    grouped dK/dV per query head."""
    spec = spec_from_hf(LLAMA_8B)
    p = memory_plan(spec, batch=1, micro_batch=1, seq=seq)
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096  # q, o; k, v; the MLP; norms
    assert p.device["backward transients"] == layer * 2 + seq * (4 * 4096 + 2 * 4096 * 2)


def test_a_lora_plan_counts_the_backwards_transients():
    """LoRA's backward holds the same attention transients, and its adapters' gradients at once
    (the plan counted none); the engine accounts the same bytes (LoraParams.transient_bytes)."""
    from horizon_cli.config.schema import LoraConfig
    from horizon_cli.lora.setup import lora_setup
    from horizon_cli.lora.sizes import lora_memory_plan

    spec = spec_from_hf(LLAMA_8B)
    setup = lora_setup(LoraConfig(r=16, targets="all-linear"), spec)
    p = lora_memory_plan(spec, setup.targets, 16, batch=1, micro_batch=1, seq=8192)
    adapters = 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 2 * (4096 + 14336) + (14336 + 4096))
    assert p.device["backward transients"] == adapters * 2 + 8192 * (4 * 4096 + 2 * 4096 * 2)


def test_auto_keep_leaves_a_margin_on_a_gpu():
    p = memory_plan(spec_from_hf(LLAMA_8B), batch=8, micro_batch=1, seq=4096)
    free = p.device_total + RESERVE + 30 * sum(p.kept_layer)  # room for 30 kept layers to the reserve
    k = auto_keep(p, Machine(host=1 << 45, device=free, what="cuda:0"))
    assert 0 < k < 30
    assert free - (p.device_total + k * sum(p.kept_layer)) >= 0.1 * free + RESERVE


def test_the_embedding_gradient_is_the_last_backwards_alone(tmp_path):
    """The untied embedding's gradient zeroes only the rows the previous backward wrote (issue 42
    item 7); after a backward over batch A and one over batch B it is bitwise B's alone."""
    from tests.support.oracle import make_engine, make_store, micro_batches, random_rows

    model, store = make_store(tmp_path, "llama", False)
    V = model.config.vocab_size
    a, b = (micro_batches(random_rows(4, V, seed=s), 2) for s in (1, 2))

    def grad_after(*batches):
        eng = make_engine(store)
        try:
            for mbs in batches:
                eng.forward_backward(mbs)
            eng.wait()
            return eng.host.units["embed"].dense_grad().clone()
        finally:
            eng.close()

    only_b, after_a = grad_after(b), grad_after(a, b)
    assert torch.equal(after_a, only_b)
    rows_a = torch.cat([mb.input_ids.reshape(-1) for mb in a]).unique()
    rows_b = torch.cat([mb.input_ids.reshape(-1) for mb in b]).unique()
    stale = rows_a[~torch.isin(rows_a, rows_b)]
    assert len(stale) and float(grad_after(a).view(V, -1)[stale].abs().sum()) > 0  # A wrote rows B does not
