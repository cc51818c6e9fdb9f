"""The overlapped pipeline on the CPU with an emulated link: event ordering, and overlap.

Every transfer, compute stretch and optimizer update is recorded on a timeline; these tests read
it back and check the schedule's invariants. Overlap is checked structurally: loads are requested
as far ahead as the prefetch depth allows, and no layer's compute waits for the next layer's
transfer. How much time that saves is a measurement, not a test: benchmarks/investigations/bench_overlap.py.
"""

import contextlib
import threading

import pytest

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.runtime.events import Event
from horizon_cli.runtime.trace import Tracer
from horizon_cli.runtime.transport import CpuTransport
from tests.support.oracle import DEVICE, make_store, micro_batches, one_thread, random_rows  # noqa: F401 (one_thread: autouse)

# The shapes of benchmarks/investigations/bench_overlap.py: 20 layers of width 192.
SHAPE = dict(
    hidden_size=192, intermediate_size=768, num_hidden_layers=20, num_attention_heads=6, num_key_value_heads=2
)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipe")
    _, st = make_store(tmp, "llama", False, dtype="bfloat16", vocab_size=512, **SHAPE)
    return st


def run(store, link_gbps: float, steps: int = 4, prefetch: int = 2, device: str = "cpu"):
    tracer = Tracer(enabled=True)
    eng = Engine(
        store,
        EngineConfig(device=device, dtype="bfloat16", link_gbps=link_gbps, prefetch=prefetch),
        OptimConfig(),
        tracer=tracer,
    )
    rows = random_rows(4 * steps, 512, seed=5, lo=120, hi=128)
    try:
        results = [eng.step(micro_batches(rows[4 * s : 4 * (s + 1)], 2), 1e-4) for s in range(steps)]
        eng.wait()
    finally:
        eng.close()
    return tracer.spans, results


def _consumer(key: str) -> str:
    if key == "head":
        return "head"
    return ("fwd " if key[0] == "f" else "bwd ") + key[1:]


def check_ordering(spans) -> None:
    spans = sorted(spans, key=lambda s: s.t0)
    loads = [s for s in spans if s.lane == "h2d" and "@" in s.name]
    computes = [s for s in spans if s.lane == "compute"]
    eps = 1e-6
    # 1. no compute before its weights arrived
    for c in computes:
        for key in [k for k in (f"f{c.name[4:]}", f"b{c.name[4:]}", "head") if _consumer(k) == c.name]:
            src = [h for h in loads if h.name.split("@")[0] == key and h.t0 <= c.t0]
            assert src, f"{c.name} ran with no load of {key}"
            assert src[-1].t1 <= c.t0 + eps, f"{c.name} started before {key} arrived"
    # 2. no buffer overwritten while its previous contents were in use
    by_slot: dict[str, list] = {}
    for h in loads:
        by_slot.setdefault(h.name.split("@")[1], []).append(h)
    for slot, hs in by_slot.items():
        for prev, nxt in zip(hs, hs[1:], strict=False):
            users = [
                c for c in computes if c.name == _consumer(prev.name.split("@")[0]) and prev.t1 <= c.t0 + eps
            ]
            if users:
                assert users[0].t1 <= nxt.t0 + eps, f"slot {slot}: {nxt.name} overwrote {prev.name} in use"
    # 3. no optimizer update before its gradients are complete; no load before its update is done
    opt = [s for s in spans if s.lane == "optimizer"]
    grads = [s for s in spans if s.lane == "d2h" and s.name.startswith("g-")]
    for o in opt:
        g = [d for d in grads if d.name == f"g-{o.name}" and d.t0 <= o.t0]
        if o.name != "embed":  # the embedding's grad is finished on the host
            assert g and g[-1].t1 <= o.t0 + eps, f"update of {o.name} before its gradient landed"
        for h in loads:
            if (
                h.name.startswith(f"f{o.name.split('.')[-1]}@")
                and o.name.startswith("layer.")
                and h.t1 > o.t0
            ):
                assert h.t0 >= o.t1 - eps or h.t1 <= o.t0 + eps, (
                    f"{h.name} streamed during the update of {o.name}"
                )
    assert opt and grads and loads


@pytest.mark.slow  # bf16, 20 layers x 2 steps; check_ordering also runs in the fast test_loads_are_issued_ahead_...
@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_schedule_ordering(store, prefetch):
    # on a GPU (scripts/gpu_check.sh) the real link; on the CPU an emulated 2 GB/s one
    link = 2.0 if DEVICE == "cpu" else 0.0
    spans, results = run(store, link_gbps=link, steps=2, prefetch=prefetch, device=DEVICE)
    check_ordering(spans)
    assert all(r.weight_loads == 2 * SHAPE["num_hidden_layers"] for r in results)


class GatedLink(CpuTransport):
    """The CPU transport with an emulated link, instrumented for structural checks.

    It logs, on the main thread (the one that issues loads and runs compute), the order in which
    loads are requested and compute starts and ends: an order fixed by the program, not by timing.
    And it holds back the copy of each layer's weights until the compute of the layer before it
    in the step's load order has started (`gates`): a pipeline that overlaps transfers with
    compute never notices; one that waits for the next layer's load before computing the current
    layer would wait for ever, and fails after `HOLD_S` instead."""

    HOLD_S = 30.0

    def __init__(self, link_gbps: float, tracer: Tracer, gates: dict[str, str]):
        super().__init__(link_gbps, tracer=tracer)
        self.log: list[tuple[str, str]] = []
        self.gates = gates  # load key -> the compute that must have started before it may land
        self.started: dict[str, threading.Event] = {}

    def _started(self, name: str) -> threading.Event:
        return self.started.setdefault(name, threading.Event())

    def h2d(self, pairs, deps=(), label: str = ""):
        key = label.split("@")[0]
        self.log.append(("issue", key))
        gate = self.gates.get(key)
        if gate is not None:
            deps = [
                *deps,
                _Hold(self._started(gate), f"the load of {key} was waited for before {gate} began"),
            ]
        return super().h2d(pairs, deps, label)

    def compute_span(self, name: str, **args):
        return self._span(name, super().compute_span(name, **args))

    @contextlib.contextmanager
    def _span(self, name: str, inner):
        self.log.append(("start", name))
        self._started(name).set()
        with inner:
            yield
        self.log.append(("end", name))


class _Hold(Event):
    def __init__(self, flag: threading.Event, what: str):
        self.flag, self.what = flag, what

    def host_wait(self) -> None:
        if not self.flag.wait(GatedLink.HOLD_S):
            raise AssertionError(f"serialized: {self.what}")

    def done(self) -> bool:
        return self.flag.is_set()


def ring_order(layers: int) -> list[str]:
    """The step's loads through the ring of `prefetch` buffers, in order (the head has its own)."""
    return [f"f{i}" for i in range(layers)] + [f"b{i}" for i in reversed(range(layers))]


def check_issue_ahead(log: list[tuple[str, str]], layers: int, prefetch: int) -> None:
    """Per step: when the compute of ring load k starts, loads k+1 .. k+prefetch-1 have been
    requested (each as early as a free buffer allows), and never more than `prefetch` ring loads
    are held at once (requested, and their compute not yet over)."""
    ring = ring_order(layers)
    steps, cur = [], []
    for ev in log:
        if ev == ("issue", "f0") and cur:
            steps.append(cur)
            cur = []
        cur.append(ev)
    steps.append(cur)
    assert len(steps) >= 2
    for events in steps:
        issued: set[str] = set()
        held = 0
        for kind, name in events:
            if kind == "issue" and name in ring:
                issued.add(name)
                held += 1
                assert held <= prefetch, f"{held} ring loads held with prefetch {prefetch}"
            elif kind == "end" and name != "head":
                held -= 1
            elif kind == "start" and name != "head":
                k = ring.index(("f" if name.startswith("fwd") else "b") + name.split()[1])
                ahead = ring[k + 1 : k + prefetch]
                late = [a for a in ahead if a not in issued]
                assert not late, f"{name} started before {late} were requested (prefetch {prefetch})"


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_loads_are_issued_ahead_and_overlap_compute(store, prefetch):
    """Structural, so a busy machine cannot spoil it (the timing itself is measured by
    benchmarks/investigations/bench_overlap.py, docs/benchmarks.md): with prefetch P, each layer's weights are
    requested P-1 layers ahead of their compute, and the compute of a layer never waits for the
    next layer's transfer, which is held back until that compute has begun."""
    layers = SHAPE["num_hidden_layers"]
    ring = ring_order(layers)
    gates = {nxt: _consumer(cur) for cur, nxt in zip(ring, ring[1:], strict=False)}
    tracer = Tracer(enabled=True)
    link = GatedLink(2.0, tracer, gates)  # an emulated 2 GB/s link
    eng = Engine(
        store,
        EngineConfig(device="cpu", dtype="bfloat16", link_gbps=2.0, prefetch=prefetch),
        OptimConfig(),
        tracer=tracer,
        transport=link,
    )
    rows = random_rows(8, 512, seed=5, lo=30, hi=40)
    try:
        for s in range(2):
            r = eng.step(micro_batches(rows[4 * s : 4 * (s + 1)], 2), 1e-4)
            assert r.weight_loads == 2 * layers
        eng.wait()
    finally:
        eng.close()
    check_issue_ahead(link.log, layers, prefetch)
    check_ordering(tracer.spans)
