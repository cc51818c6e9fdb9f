"""A bf16 copy computed with in fp32 (state.widen): the stored bytes cross the link and are
upcast on the device, just before the compute.

Checked: a LoRA run on a bf16 store computing in fp32 across an emulated link moves each unit's
stored bytes (counted load by load through the transport, not timed), and trains bitwise as the
run without a link, where the host holds an fp32 copy (kept layers and a tied head included);
the same through the fake CUDA transport, in stream order; lean computing in fp32 streams its
bf16 weight, and its first step computes with exactly exact fp32's weights (the same loss); the
memory plan counts the bf16 buffers and the fp32 upcast buffers as the engine allocates them.
"""

from __future__ import annotations

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, LoraConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.lora.setup import lora_setup
from horizon_cli.lora.sizes import lora_memory_plan
from horizon_cli.planning.memory import memory_plan
from horizon_cli.runtime.transport import CpuTransport
from tests.support.oracle import make_store, micro_batches, random_rows

LINK = 50.0  # GB/s: an emulated link (copies into device buffers of their own), not a slow one
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3)


class Counting(CpuTransport):
    """The CPU transport, recording each weight load's bytes: (load key, bytes of its weights)."""

    def __init__(self, link: float):
        super().__init__(link)
        self.loads: list[tuple[str, int]] = []

    def h2d(self, pairs, deps=(), label=""):
        pairs = list(pairs)
        if "@" in label and pairs:  # a loader's load: its weights first, then any extras
            self.loads.append((label.split("@")[0], pairs[0][1].numel() * pairs[0][1].element_size()))
        return super().h2d(pairs, deps, label)


def unit_of(key: str) -> str:
    return key if key in ("head", "embed") else f"layer.{int(key[1:])}"


def run(store, rows, link=0.0, keep=0, lora=True, memory="exact", transport=None, steps=2):
    t = transport if transport is not None else Counting(link)
    setup = lora_setup(LoraConfig(r=4, alpha=8, targets="all-linear"), store.arch) if lora else None
    e = Engine(
        store,
        EngineConfig(device="cpu", dtype="float32", loss_chunk=16, link_gbps=link),
        OptimConfig(kernel="torch", memory=memory),
        transport=t,
        lora=setup,
        keep=keep,
    )
    try:
        losses = [e.step(micro_batches(rows[4 * s : 4 * s + 4], 2), 1e-3).loss for s in range(steps)]
        e.wait()
        masters = {u: st.master().clone() for u, st in e.host.units.items()}
        upcast = e.p.t.memory.current.get("dequantized layer", 0)
        return losses, masters, t, e.p.loader.weight_bytes(), upcast
    finally:
        e.close()


@pytest.mark.parametrize("tie,keep", [(False, 0), (True, 0), (False, 2)])  # 2 kept: buffers of their own
def test_a_bf16_base_crosses_the_link_as_stored_and_trains_as_before(tmp_path, tie, keep):
    model, store = make_store(tmp_path, "llama", tie, dtype="bfloat16", **SHAPE)
    rows = random_rows(8, model.config.vocab_size, seed=2)
    want = run(store, rows)  # no link: the host holds the base in fp32 (nothing crosses)
    got = run(store, rows, link=LINK, keep=keep)
    assert got[0] == want[0]
    assert all(torch.equal(got[1][u], want[1][u]) for u in want[1])
    loads = got[2].loads
    layers = store.arch.n_layers
    assert len([k for k, _ in loads if k != "head" and k != "embed"]) == 2 * (2 * layers - keep)
    for key, n in loads:  # every load carries the unit's stored bytes: bf16, not an fp32 copy
        assert n == store.unit_bytes(unit_of(key)) == store.layout(unit_of(key)).numel * 2, key
    assert not [k for k, _ in want[2].loads]  # without a link the loader lends the host's buffers


def test_the_cuda_transport_upcasts_on_the_compute_stream(tmp_path):
    """Through the fake CUDA (tests/support/fake_cuda.py): the bf16 base and lean's bf16 weight upcast on
    the compute stream in stream order, bitwise as on the CPU without a link."""
    from tests.runtime import test_cuda_transport as tc
    from tests.support.fake_cuda import FakeCuda

    model, store = make_store(tmp_path, "llama", True, dtype="bfloat16", **SHAPE)
    rows = random_rows(8, model.config.vocab_size, seed=2)
    for lora, memory in ((True, "exact"), (False, "lean")):
        fake = FakeCuda(index=1)
        with fake.watching():
            got = run(store, rows, lora=lora, memory=memory, transport=tc.cuda(fake))
        want = run(store, rows, lora=lora, memory=memory)
        assert got[0] == want[0], memory
        assert all(torch.equal(got[1][u], want[1][u]) for u in want[1]), memory
        assert fake.problems == []


def test_lean_in_fp32_streams_its_bf16_weight(tmp_path):
    model, store = make_store(tmp_path, "llama", dtype="bfloat16", **SHAPE)
    rows = random_rows(8, model.config.vocab_size, seed=2)
    lean = run(store, rows, link=LINK, lora=False, memory="lean")
    for key, n in lean[2].loads:
        assert n == store.layout(unit_of(key)).numel * 2, key
    alone = run(store, rows, lora=False, memory="lean")  # no link: the same upcast, from the host
    assert lean[0] == alone[0] and all(torch.equal(lean[1][u], alone[1][u]) for u in alone[1])
    exact = run(store, rows, lora=False, steps=1)  # fp32 exact: its master is the stored bf16 at first
    assert lean[0][0] == exact[0][0]  # so the first step computes with the very same weights


@pytest.mark.parametrize("tie", [False, True])
def test_the_plan_counts_bf16_buffers_and_fp32_upcast_buffers(tmp_path, tie):
    model, store = make_store(tmp_path, "llama", tie, dtype="bfloat16", **SHAPE)
    rows = random_rows(8, model.config.vocab_size, seed=2)
    spec, setup = store.arch, lora_setup(LoraConfig(r=4, alpha=8, targets="all-linear"), store.arch)
    shape = dict(batch=4, micro_batch=2, seq=32, prefetch=2, loss_chunk=16)
    for plan, got in (
        (
            lora_memory_plan(spec, setup.targets, 4, "float32", stream="bfloat16", **shape),
            run(store, rows, link=LINK, steps=1),
        ),
        (
            memory_plan(spec, "float32", memory="lean", **shape),
            run(store, rows, link=LINK, lora=False, memory="lean", steps=1),
        ),
    ):
        _, _, _, weights, upcast = got
        assert plan.device["weight buffers"] == weights  # bf16: prefetch layers, the head (+ tied table)
        assert plan.device["upcast buffers (layer, head)"] == upcast > 0  # fp32: one layer, the head
    base = lora_memory_plan(spec, setup.targets, 4, "float32", stream="bfloat16", **shape)
    assert base.host["base weights (frozen)"] == sum(store.unit_bytes(u.name) for u in store.units)
    wide = lora_memory_plan(spec, setup.targets, 4, "float32", **shape)  # no link: the host's fp32 copy
    assert wide.host["base weights (frozen)"] == 2 * base.host["base weights (frozen)"]
    assert "upcast buffers (layer, head)" not in wide.device


def test_a_forward_only_engine_upcasts_on_the_device_as_the_host_did(tmp_path):
    """Generation, evaluation, a preference run's reference: the bf16 base crosses as stored and
    the logits are bitwise those of the host's fp32 copy."""
    model, store = make_store(tmp_path, "llama", True, dtype="bfloat16", **SHAPE)
    mb = micro_batches(random_rows(2, model.config.vocab_size, seed=4), 2)[0]
    out = []
    for link in (0.0, LINK):
        t = Counting(link)
        e = Engine(
            store,
            EngineConfig(device="cpu", dtype="float32", link_gbps=link),
            OptimConfig(kernel="torch"),
            transport=t,
            forward_only=True,
        )
        try:
            out.append((e.logits(mb), t.loads, e.base.units["layer.0"].stream.dtype))
        finally:
            e.close()
    (want, none, wide), (got, loads, narrow) = out
    assert torch.equal(got, want) and got.dtype == torch.float32
    assert (wide, narrow, none) == (torch.float32, torch.bfloat16, [])
    assert loads and all(n == store.unit_bytes(unit_of(k)) for k, n in loads)


def test_the_generation_plan_counts_a_sweep_in_the_stored_bytes(tmp_path):
    """generate.budget: a narrow base's sweep moves its bf16 bytes, as the forward-only engine
    above does, and its upcast buffers are on the device."""
    from horizon_cli.generate.budget import plan_generation

    _, store = make_store(tmp_path, "llama", dtype="bfloat16", **SHAPE)
    wide = plan_generation(store.arch, "float32", [(2, 4, 12)], 0)
    narrow = plan_generation(store.arch, "float32", [(2, 4, 12)], 0, stream="bfloat16")
    stored = sum(store.unit_bytes(f"layer.{i}") for i in range(store.arch.n_layers)) + store.unit_bytes(
        "head"
    )
    assert narrow.sweep_bytes == stored and wide.sweep_bytes == 2 * stored
    assert narrow.host["base weights"] * 2 == wide.host["base weights"]
    assert (
        "upcast buffers (layer, head)" in narrow.device and "upcast buffers (layer, head)" not in wide.device
    )


def test_sharded_runs_gather_the_stored_bytes_and_upcast_after(tmp_path):
    """Two ranks under torchrun (tests/parallel/dist_peak.py): a bf16 LoRA base and lean's bf16 weight,
    computing in fp32, all-gathered in bf16 over an emulated link and upcast after the gather,
    step as the same sharded run without a link (the host's fp32 copy; lean: its upcast from the
    host) to the bit, and the plan's device total is each rank's peak."""
    import json

    from tests.parallel.test_dist import torchrun

    _, store = make_store(tmp_path, "llama", dtype="bfloat16", **SHAPE)
    lora = {"r": 4, "alpha": 8}
    cases = []
    for link in (0.0, 1e6):
        engine = {"device": "cpu", "dtype": "float32", "prefetch": 2, "loss_chunk": 16, "link_gbps": link}
        cases += [
            {"name": f"lora-{link}", "engine": engine, "lora": lora, "memory": "exact"},
            {"name": f"lean-{link}", "engine": engine, "lora": None, "memory": "lean"},
        ]
    for c in cases:
        c.update(store=str(tmp_path / "store"), batch=4, micro=1, seq=64)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    r = torchrun(2, tmp_path / "cases.json", tmp_path, cli=False, script="dist_peak.py")
    assert r.returncode == 0, r.stderr[-3000:]
    spec = store.arch
    setup = lora_setup(LoraConfig(**lora), spec)
    shape = dict(batch=4, micro_batch=1, seq=64, prefetch=2, loss_chunk=16, world=2)
    plans = {
        "lora": lora_memory_plan(spec, setup.targets, 4, "float32", stream="bfloat16", **shape),
        "lean": memory_plan(spec, "float32", memory="lean", **shape),
    }
    for rank in range(2):
        losses = json.loads((tmp_path / f"rank{rank}.loss.json").read_text())
        peaks = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for kind, plan in plans.items():
            assert losses[f"{kind}-0.0"] == losses[f"{kind}-1000000.0"], kind
            assert plan.device_total == peaks[f"{kind}-1000000.0"], (kind, plan.device)
