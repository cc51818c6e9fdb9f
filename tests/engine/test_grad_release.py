"""Gradient release (optim.grad_release: engine.release): each unit's AdamW inside the backward.

With grad_clip 0 a release run trains bit for bit what the same run without release trains; with
grad_clip > 0 its norm-first pass does too (clipping firing); host gradients come in chunks
through RELEASE_CHUNKS fixed-size buffers, none per unit but the embedding's (units of several
chunks: tiny slices and chunks); the updates run while the backward is still going; a non-finite
gradient refuses every update before any lands, or stops the run with one line.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from horizon_cli.config.schema import EngineConfig, LoraConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.errors import HorizonError
from horizon_cli.lora.setup import lora_setup
from horizon_cli.optim.modes import RELEASE_CHUNK, RELEASE_CHUNKS
from horizon_cli.runtime.trace import Tracer
from horizon_cli.state import pool, slices
from horizon_cli.state.optimizer import OptimizerWorker
from tests.support.oracle import DEVICE, make_store, micro_batches, one_thread, random_rows  # noqa: F401


def engine(
    store, release, *, clip=0.0, memory="exact", keep=0, tile=0, lora=None, tracer=None, link=0.0
) -> Engine:
    ecfg = EngineConfig(
        device=DEVICE, dtype="float32", loss_chunk=16, keep_activations=keep, seq_tile=tile, link_gbps=link
    )
    ocfg = OptimConfig(
        kernel="torch",
        lr=1e-2,
        weight_decay=0.1,
        grad_clip=clip,
        memory=memory,
        grad_release="true" if release else "false",
    )
    return Engine(store, ecfg, ocfg, lora=lora, tracer=tracer)


def state(eng: Engine) -> dict[str, torch.Tensor]:
    """Every trained unit's weights and optimizer state (not its gradient)."""
    return {
        f"{u}.{k}": t.clone()
        for u, st in eng.host.units.items()
        for k, t in st.buffers().items()
        if k != "grad"
    }


def train(store, release, steps=3, micro=2, **kw):
    eng = engine(store, release, **kw)
    vocab = store.arch.vocab
    rows = random_rows(4 * steps, vocab, seed=3, lo=10, hi=24)
    try:
        res = [eng.step(micro_batches(rows[4 * s : 4 * s + 4], micro), 1e-2) for s in range(steps)]
        eng.wait()
        if release:
            held = [u for u, st in eng.host.units.items() if st.grad.numel()]
            assert held == ["embed"] or kw.get("lora"), held  # the rest crossed in chunks
            embed = eng.host.units.get("embed")  # an untied table's: the rows the last step touched
            assert embed is None or embed.rows is None or 0 < len(embed.rows) < store.arch.vocab
        return [(r.loss, r.grad_norm, r.skipped) for r in res], state(eng)
    finally:
        eng.close()


def same(a, b) -> None:
    (ra, sa), (rb, sb) = a, b
    assert ra == rb
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize(
    "family,tie,over,kw",
    [
        ("llama", False, {}, {}),
        ("qwen2", True, {}, {}),  # a tied head: the embedding's buffer held from the head to the end
        ("llama", False, {}, dict(memory="lean")),
        ("llama", False, {}, dict(keep=1)),
        ("llama", False, {}, dict(tile=8)),
        ("llama", False, {}, dict(link=1e6)),  # over an emulated link: device sums copied to the pool
        ("qwen2", True, {}, dict(link=1e6, memory="lean")),
        ("mixtral", False, dict(output_router_logits=True), {}),
    ],
)
def test_release_trains_bit_for_bit_what_no_release_trains(tmp_path, family, tie, over, kw):
    _, store = make_store(tmp_path, family, tie, **over)
    same(train(store, True, **kw), train(store, False, **kw))


@pytest.fixture
def small_chunks(monkeypatch):
    """Slices of 128 elements (two lean blocks), chunks of 3 slices: every unit crosses in
    several chunks, most units' last one short, and the pool's 3 buffers are reused many times a
    step (a real model's 64 MiB chunks hold a whole tiny unit)."""
    monkeypatch.setattr(slices, "SLICE", 128)
    monkeypatch.setattr(pool, "RELEASE_CHUNK", 3 * 128)


@pytest.mark.parametrize(
    "family,tie,kw",
    [
        ("llama", False, {}),
        ("qwen2", True, dict(link=1e6, memory="lean")),  # narrowed to bf16 on the "device" first
        ("llama", False, dict(link=1e6, clip=0.05)),  # the norm-first pass's buffers too
        ("llama", False, dict(keep=1, link=1e6)),  # a kept layer's sums
        ("llama", False, dict(tile=8)),
        ("mixtral", False, dict(link=1e6)),  # experts: segments with frozen gaps between
    ],
)
def test_release_in_small_chunks_is_bitwise(tmp_path, small_chunks, family, tie, kw):
    _, store = make_store(tmp_path, family, tie)
    got = train(store, True, **kw)
    slices.SLICE = 1 << 22  # the reference walks its units in the default slices: the same updates
    same(got, train(store, False, **kw))


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_release_with_lora_is_bitwise(tmp_path, clip):
    """With clipping, LoRA's adapters (small, kept whole) are updated after its one pass, as
    without release: no norm-first pass, the same weight loads."""
    _, store = make_store(tmp_path, "llama", False)
    setup = lora_setup(LoraConfig(r=4, targets="all-linear"), store.arch)
    same(train(store, True, lora=setup, clip=clip), train(store, False, lora=setup, clip=clip))
    loads = []
    for release in (True, False):
        eng = engine(store, release, lora=setup, clip=clip)
        try:
            rows = random_rows(4, store.arch.vocab, seed=3, lo=10, hi=24)
            loads.append(eng.step(micro_batches(rows, 2), 1e-2).weight_loads)
        finally:
            eng.close()
    assert loads[0] == loads[1] == 2 * store.arch.n_layers


def test_release_of_layers_run_in_a_loop_is_bitwise(tmp_path):
    """Dory calls its recurrent layers twice: a unit is released after its earliest call."""
    from tests.arch.test_loops import dory

    _, store = dory(tmp_path)
    same(train(store, True), train(store, False))


def test_release_of_a_loop_in_small_chunks_is_bitwise(tmp_path, small_chunks):
    """A unit called twice sends its summed gradient in chunks after its earliest call."""
    from tests.arch.test_loops import dory

    _, store = dory(tmp_path)
    got = train(store, True, link=1e6)
    slices.SLICE = 1 << 22
    same(got, train(store, False, link=1e6))


def test_norm_first_pass_equals_no_release_with_clipping(tmp_path):
    _, store = make_store(tmp_path, "llama", False)
    got, want = train(store, True, clip=0.05), train(store, False, clip=0.05)
    assert all(norm > 0.05 for _, norm, _ in want[0]), "clipping must fire"
    same(got, want)


def test_a_release_run_holds_the_pool_not_a_gradient_per_unit(tmp_path):
    _, store = make_store(tmp_path, "llama", False)
    eng = engine(store, True)
    try:
        units = eng.host.units
        got = eng.host.chunks
        assert got is not None and len(got.bufs) == RELEASE_CHUNKS
        biggest = max(st.stream.numel() for u, st in units.items() if u != "embed")
        assert got.nbytes() == RELEASE_CHUNKS * min(biggest, RELEASE_CHUNK) * 4
        assert units["embed"].rows is not None  # its own, fp32, the rows a step touches (compact)
        assert all(st.grad.numel() == 0 for u, st in units.items() if u != "embed")
        assert eng.host.nbytes()["grad"] == got.nbytes() + units["embed"].grad.numel() * 4
    finally:
        eng.close()


class HoldBackward(Tracer):
    """Holds the backward of layer 0 until the head's update has run (10 s at most)."""

    def __init__(self, updated: threading.Event):
        super().__init__(enabled=False)
        self.updated, self.waited = updated, []

    @contextlib.contextmanager
    def span(self, lane, name, **args):
        if lane == "compute" and name == "bwd 0":
            self.waited.append(self.updated.wait(timeout=10.0))
        with super().span(lane, name, **args):
            yield


def test_the_head_is_updated_before_the_backward_reaches_layer_0(tmp_path, monkeypatch):
    """Without release every update waits for the end of the backward: the hold times out."""
    _, store = make_store(tmp_path, "llama", False)
    updated = threading.Event()
    update = OptimizerWorker._update

    def noting(self, st, h, dep, g=None, lo=0):
        update(self, st, h, dep, g, lo)
        if st.name == "head":
            updated.set()

    monkeypatch.setattr(OptimizerWorker, "_update", noting)
    tracer = HoldBackward(updated)
    eng = engine(store, True, tracer=tracer)
    try:
        eng.step(micro_batches(random_rows(4, store.arch.vocab, seed=1), 2), 1e-2)
        eng.wait()
    finally:
        eng.close()
    assert tracer.waited == [True]


def poison_grad(monkeypatch, unit: str) -> None:
    """A NaN in `unit`'s gradient sum as the reduce sends it (every step)."""
    from horizon_cli.engine.reduce import LocalReduce

    layer = LocalReduce.layer

    def poisoned(self, u, g, k, sq, chunks):
        if u == unit:
            g[0] = float("nan")
        return layer(self, u, g, k, sq, chunks)

    monkeypatch.setattr(LocalReduce, "layer", poisoned)


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_nan_in_the_top_layer_with_nothing_updated_before_skips_or_stops(tmp_path, monkeypatch, clip):
    """grad_clip > 0 (norm-first): skipped whole; grad_clip 0: the head was updated before the
    NaN was found, so the step stops with one line, and no other unit was touched after it."""
    _, store = make_store(tmp_path, "llama", False)
    eng = engine(store, True, clip=clip)
    try:
        before = state(eng)
        poison_grad(monkeypatch, "layer.1")
        mbs = micro_batches(random_rows(4, store.arch.vocab, seed=1), 2)
        if clip:
            res = eng.step(mbs, 1e-2)
            eng.wait()
            assert res.skipped
            same(([], state(eng)), ([], before))
        else:
            with pytest.raises(
                HorizonError, match=r"non-finite gradient \(layer\.1\) after 1 unit was already"
            ):
                eng.step(mbs, 1e-2)
            after = state(eng)
            changed = {k.split(".stream")[0] for k in after if not torch.equal(after[k], before[k])}
            assert {k.rsplit(".", 1)[0] for k in changed} == {"head"}
    finally:
        eng.close()


def test_the_norm_first_pass_loads_what_the_dry_run_says(tmp_path):
    """The dry run's clipping line (planning.release.norm_first_loads) counts the layer loads a
    norm-first step makes: two whole passes, so 4 per recomputed layer and 2 per kept layer."""
    from horizon_cli.planning.release import norm_first_loads

    _, store = make_store(tmp_path, "llama", False)
    layers, rows = store.arch.n_layers, random_rows(4, store.arch.vocab, seed=3, lo=10, hi=24)
    loads = {}
    for release in (True, False):
        eng = engine(store, release, clip=1.0, keep=1)
        try:
            loads[release] = eng.step(micro_batches(rows, 2), 1e-2).weight_loads
        finally:
            eng.close()
    assert loads[False] == 2 * (layers - 1) + 1
    assert loads[True] == norm_first_loads(layers - 1, 1) == 2 * loads[False]
