"""The pipeline's threads under failure and at the step boundary.

An error at any layer (a CUDA out-of-memory on a first run is the likely one) must not leave a
copy worker waiting for ever on work the main thread will now never issue: the engine poisons its
pending promises, `close()` returns, and `horizon train` exits with one line. And at the start of a
step, layer 0's compute waits only for what it needs: its own weights and the embedding rows, not
for the CPU optimizer's update of layer 1.
"""

import contextlib
import threading

import pytest
import torch
from typer.testing import CliRunner

from horizon_cli.config.schema import EngineConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.runtime.transport import CpuTransport
from horizon_cli.state.optimizer import OptimizerWorker
from tests.conftest import chat_rows, write_config, write_jsonl
from tests.support.oracle import StartSignal, make_store, micro_batches, random_rows

LAYERS = 6


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    _, st = make_store(tmp_path_factory.mktemp("robust"), "llama", False, num_hidden_layers=LAYERS)
    return st


def fail_at(transport, name: str, error: BaseException):
    """Make the compute span `name` (e.g. "fwd 3") raise, as a failing kernel would."""
    span = transport.compute_span

    @contextlib.contextmanager
    def failing(n, **args):
        if n == name:
            raise error
        with span(n, **args):
            yield

    transport.compute_span = failing


def closes_within(engine, seconds: float) -> bool:
    t = threading.Thread(target=engine.close, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


@pytest.mark.parametrize("prefetch", [1, 2, 3, 4])
@pytest.mark.parametrize("where", ["fwd 0", f"fwd {LAYERS - 2}", "head", "bwd 2"])
def test_an_error_anywhere_stops_the_engine_and_close_returns(store, prefetch, where):
    eng = Engine(
        store, EngineConfig(device="cpu", dtype="float32", prefetch=prefetch), OptimConfig(kernel="torch")
    )
    rows = random_rows(8, 96, seed=1)
    eng.step(micro_batches(rows[:4], 2), 1e-3)  # a normal step first: updates in flight
    fail_at(eng.t, where, RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        eng.step(micro_batches(rows[4:], 2), 1e-3)
    assert closes_within(eng, 10.0), f"close() hangs after an error at {where} with prefetch {prefetch}"
    with pytest.raises(Exception, match="stopped at an earlier error"):
        eng.step(micro_batches(rows[4:], 2), 1e-3)


def test_train_exits_with_one_line_after_a_device_oom(tiny_store, tmp_path, monkeypatch):
    # prefetch 4 with 2 layers: the backward load of layer 1 is queued before the forward of layer 0,
    # and waits for layer 1's saved input, which an error in layer 0 means is never sent (so both
    # layers recompute: a kept layer has no backward load)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    engine = {"prefetch": 4, "keep_activations": 0}
    cfg = write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run", engine=engine)
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    span = CpuTransport.compute_span

    def failing(self, name, **args):
        if name == "fwd 0":
            raise oom
        return span(self, name, **args)

    monkeypatch.setattr(CpuTransport, "compute_span", failing)
    from horizon_cli.cli import app

    result = {}
    t = threading.Thread(
        target=lambda: result.update(r=CliRunner().invoke(app, ["train", str(cfg)])), daemon=True
    )
    t.start()
    t.join(60)
    assert not t.is_alive(), "horizon train did not exit after the error"
    r = result["r"]
    assert r.exit_code == 1, r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "device out of memory" in errors[0], r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("link_gbps", [0.0, 1.0])
def test_layer_0_does_not_wait_for_the_update_of_layer_1(store, monkeypatch, link_gbps):
    """Layer 1's update is held until layer 0's forward has started: if layer 0 waited for it,
    the hold would time out (and the step would wait for it)."""
    tracer = StartSignal("fwd 0", nth=2, enabled=True)  # step 2's
    held_too_long = []
    update = OptimizerWorker._update

    def holding_update(self, st, h, dep):
        if st.name == "layer.1" and not tracer.started.wait(timeout=10.0):
            held_too_long.append(st.name)
        return update(self, st, h, dep)

    monkeypatch.setattr(OptimizerWorker, "_update", holding_update)
    ecfg = EngineConfig(device="cpu", dtype="float32", prefetch=2, link_gbps=link_gbps)
    eng = Engine(store, ecfg, OptimConfig(kernel="torch"), tracer=tracer)
    rows = random_rows(8, 96, seed=2)
    try:
        eng.step(micro_batches(rows[:4], 2), 1e-3)
        eng.step(micro_batches(rows[4:], 2), 1e-3)  # its layer 0 must start while layer 1 is held
        eng.wait()
    finally:
        eng.close()
    assert not held_too_long, "layer 0's forward waited for the optimizer's update of layer 1"
    # and on the timeline: step 2's layer-0 compute began before layer 1's update ended
    spans = tracer.spans
    fwd0 = [s for s in spans if s.lane == "compute" and s.name == "fwd 0"][1]
    upd1 = [s for s in spans if s.lane == "optimizer" and s.name == "layer.1"][0]
    assert fwd0.t0 < upd1.t1
