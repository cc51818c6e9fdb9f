"""Kept layers (engine.keep_activations): the last K layers keep their graph and weights from the
forward to the backward. Kept and recomputed runs give the same model bit for bit (the kept graph
is the graph recompute builds), a step moves 2L - K layer loads, the plan's K is what its budget
holds (and what the engine and the trainer use), the plan's bytes cover what a kept layer's graph
really saves, and a run killed with K > 0 resumes bitwise."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from horizon_cli.cli import app
from horizon_cli.config import load_config
from horizon_cli.config.schema import EngineConfig, LoraConfig, OptimConfig
from horizon_cli.engine import Engine
from horizon_cli.engine.kept_layers import KeptLayers
from horizon_cli.errors import ConfigError
from horizon_cli.lora.setup import lora_setup
from horizon_cli.planning.fit import RESERVE, Machine
from horizon_cli.planning.ladder import fit_parts, plan_for
from horizon_cli.runtime.cuda import CudaTransport
from horizon_cli.store import Store
from horizon_cli.train import run_training
from tests.conftest import chat_rows, write_config, write_jsonl
from tests.support.fake_cuda import FakeCuda
from tests.support.oracle import (  # noqa: F401
    DEVICE,
    engine_weights,
    make_store,
    micro_batches,
    one_thread,
    random_rows,
    rel_err,
)

VOCAB = 96


def run(store, dtype, keep, link=0.0, lora=None, transport=None, steps=3, objective=None):
    """`steps` optimizer steps of 4 rows in 2 micro-batches: (results, trained tensors). On
    HORIZON_TEST_DEVICE (scripts/gpu_check.sh: cuda) unless a transport is given."""
    device = "cpu" if transport is not None or link else DEVICE
    ecfg = EngineConfig(device=device, dtype=dtype, loss_chunk=16, link_gbps=link)
    ocfg = OptimConfig(kernel="torch", lr=1e-3)
    eng = Engine(store, ecfg, ocfg, keep=keep, lora=lora, transport=transport, objective=objective)
    try:
        res = [eng.step(micro_batches(random_rows(4, VOCAB, seed=s), 2), 1e-3) for s in range(steps)]
        eng.wait()
        w = eng.host.tensors() if lora is not None else engine_weights(eng)
        return res, {k: v.clone() for k, v in w.items()}
    finally:
        eng.close()


def assert_same(a, b, dtype: str = "float32", device: str = "cpu") -> None:
    """Bitwise on the CPU; on CUDA within float tolerance (kernels may differ with autograd on)."""
    (ra, wa), (rb, wb) = a, b
    assert wa.keys() == wb.keys()
    if device == "cpu":
        assert [(r.loss, r.grad_norm, r.aux_loss) for r in ra] == [
            (r.loss, r.grad_norm, r.aux_loss) for r in rb
        ]
        for k in wa:
            assert torch.equal(wa[k], wb[k]), k
        return
    tol = 1e-5 if dtype == "float32" else 1e-2
    assert all(abs(x.loss - y.loss) <= tol * abs(y.loss) for x, y in zip(ra, rb, strict=True))
    for k in wa:
        assert rel_err(wa[k], wb[k]) < tol, k


@pytest.mark.parametrize("dtype,keep,link", [("float32", 3, 0.0), ("bfloat16", 1, 1e6)])
def test_kept_equals_recomputed_bitwise(tmp_path, dtype, keep, link):
    """Every layer kept, host memory lent (fp32); the top layer kept, copies over a link (bf16):
    weights, losses and norms bitwise those of recomputing every layer; 2L - K layer loads."""
    _, store = make_store(tmp_path, "llama", False, dtype=dtype, num_hidden_layers=3)
    ref, kept = run(store, dtype, 0, link), run(store, dtype, keep, link)
    assert_same(ref, kept, dtype, DEVICE if not link else "cpu")
    assert all(r.weight_loads == 6 and r.kept_layers == 0 for r in ref[0])
    assert all(r.weight_loads == 6 - keep and r.kept_layers == keep for r in kept[0])
    if link:  # a kept layer's weights and saved inputs cross the link once, not twice
        assert kept[0][-1].h2d_bytes < ref[0][-1].h2d_bytes


def test_moe_and_qlora_kept_equal_recomputed(tmp_path):
    """MoE with its aux loss trained (router statistics recorded in the forward, the layer's
    share added in the backward from the logits its graph held), every layer kept; and QLoRA with
    dropout, the top two of three layers kept (each in a dequantized buffer of its own: the shared
    one serves the next layer's forward before the kept layer's backward)."""
    _, moe = make_store(tmp_path / "moe", "qwen3_moe", False, dtype="bfloat16", output_router_logits=True)
    ref, kept = run(moe, "bfloat16", 0), run(moe, "bfloat16", moe.arch.n_layers)
    assert_same(ref, kept, "bfloat16", DEVICE)
    assert ref[0][0].aux_loss is not None
    _, nf4 = make_store(
        tmp_path / "nf4", "llama", False, dtype="bfloat16", quantize="nf4", num_hidden_layers=3
    )

    def setup():
        return lora_setup(LoraConfig(r=4, alpha=8, dropout=0.1, targets="all-linear"), nf4.arch)

    ref, kept = run(nf4, "bfloat16", 0, lora=setup()), run(nf4, "bfloat16", 2, lora=setup())
    assert_same(ref, kept, "bfloat16", DEVICE)
    assert [r.weight_loads for r in kept[0]] == [4, 4, 4]


def test_a_sequence_objective_kept_equals_recomputed(tmp_path):
    """The head is the same for kept layers: a two-pass objective (the preference losses' seam,
    engine/objective.py) gives the same model keeping every layer as recomputing them."""
    from horizon_cli.engine.objective import SequenceObjective

    class TwoPassCE(SequenceObjective):  # cross-entropy as a function of per-token log-probs
        name = "two-pass-ce"

        def loss(self, logps, targets):
            return -torch.cat(logps).sum(), {"logps_sum": torch.cat(logps).sum()}

    _, store = make_store(tmp_path, "llama", True, num_hidden_layers=2)
    ref, kept = (
        run(store, "float32", 0, objective=TwoPassCE()),
        run(store, "float32", 2, objective=TwoPassCE()),
    )
    assert_same(ref, kept, "float32", DEVICE)
    assert [r.stats for r in ref[0]] == [r.stats for r in kept[0]] or DEVICE != "cpu"


@pytest.mark.parametrize("where", ["fwd 0", "fwd 3 kept", "bwd 2 kept", "bwd 1"])
def test_an_error_with_kept_layers_stops_the_engine_and_close_returns(tmp_path, where):
    """An error anywhere in a step that keeps the top 2 of 4 layers (held buffers, queued
    backward loads waiting for saved inputs never sent): the step raises, close() returns, the
    engine refuses further work."""
    from tests.engine.test_engine_robust import closes_within, fail_at

    _, store = make_store(tmp_path, "llama", False, num_hidden_layers=4)
    eng = Engine(
        store, EngineConfig(device="cpu", dtype="float32", prefetch=3), OptimConfig(kernel="torch"), keep=2
    )
    rows = random_rows(8, VOCAB, seed=1)
    eng.step(micro_batches(rows[:4], 2), 1e-3)
    fail_at(eng.t, where, RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        eng.step(micro_batches(rows[4:], 2), 1e-3)
    assert closes_within(eng, 10.0), where
    with pytest.raises(Exception, match="stopped at an earlier error"):
        eng.step(micro_batches(rows[4:], 2), 1e-3)


def test_kept_slots_are_ordered_on_cuda_streams(tmp_path):
    """The CUDA transport (through tests/support/fake_cuda.py's checks of every stream access) with a kept
    layer: the same numbers as the CPU recomputing every layer, no access out of order."""
    _, store = make_store(tmp_path, "llama", True, dtype="bfloat16", num_hidden_layers=3)
    fake = FakeCuda(index=0)
    with fake.watching():
        got = run(store, "bfloat16", 2, transport=CudaTransport(torch.device("cuda", 0), api=fake), steps=2)
    assert_same(run(store, "bfloat16", 0, steps=2), got)
    assert fake.problems == []


@pytest.mark.parametrize("tile", [0, 16])
def test_plan_covers_what_kept_graphs_save(tmp_path, monkeypatch, tile):
    """What the kept layers' forwards really save for their backward (every tensor autograd packs,
    by storage, weights excluded) stays within the engine's accounting of their graphs, which is
    the plan's formula (planning.memory.kept_graph_bytes) on the step's shapes; in tiles of 16
    tokens (engine.seq_tile) too, where the native layer's accounting is below the untiled one's."""
    saved: dict[int, int] = {}
    weights: set[int] = set()

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            saved[s.data_ptr()] = s.nbytes()
        return t

    forward = KeptLayers.forward

    def counted(self, *args):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return forward(self, *args)

    monkeypatch.setattr(KeptLayers, "forward", counted)
    over = dict(hidden_size=64, intermediate_size=160, num_attention_heads=8, num_key_value_heads=2)
    cases = [("llama", "float32", None), ("mistral", "bfloat16", None), ("qwen2", "bfloat16", None),
             ("gemma2", "bfloat16", None), ("qwen3_moe", "bfloat16", None),
             ("qwen3", "bfloat16", LoraConfig(r=4, alpha=8, dropout=0.1, targets="all-linear")),
             ("llama", "bfloat16", LoraConfig(r=4, alpha=8, targets="all-linear"))]  # fmt: skip
    for family, dtype, lcfg in cases:
        extra = {"head_dim": 8} if family in ("gemma2", "qwen3_moe", "qwen3") else {}
        _, store = make_store(
            tmp_path / f"{family}-{dtype}-{bool(lcfg)}", family, False, dtype=dtype, **over, **extra
        )
        lora = lora_setup(lcfg, store.arch) if lcfg else None
        accounted = {}
        for t in {0, tile}:
            ecfg = EngineConfig(device="cpu", dtype=dtype, loss_chunk=16, seq_tile=t)
            eng = Engine(store, ecfg, OptimConfig(kernel="torch"), lora=lora, keep=2)
            try:
                weights.clear()
                weights.update(u.stream.untyped_storage().data_ptr() for u in eng.units.values())
                if eng.base is not None:
                    weights.update(b.untyped_storage().data_ptr() for b in eng.base.kept.values())
                saved.clear()
                eng.step(micro_batches(random_rows(4, VOCAB, seed=1, lo=40, hi=48), 2), 1e-3)
                accounted[t] = eng.t.memory.current["kept graphs"]
                assert 0 < sum(saved.values()) <= accounted[t], (family, t, sum(saved.values()), accounted[t])
            finally:
                eng.close()
        if tile and store.arch.generic is None:  # natively the MLP's 4 I a token is not saved whole
            assert accounted[tile] < accounted[0], (family, accounted)


def test_forward_only_engines_keep_nothing_and_generation_beside_kept_layers(tmp_path):
    """K applies to training steps only: a forward-only engine (generation, evaluation) keeps no
    layer and holds no kept buffer whatever engine.keep_activations says. A training engine
    keeping 2 of 3 layers generates (the KV cache on the device, and on the host through the
    ring's extra buffers, over a link) the tokens one recomputing every layer generates, and
    trains on after it as that one does: the decode path's loads never touch the kept buffers."""
    from horizon_cli.generate.decoder import Decoder
    from horizon_cli.model.sample import Sampler

    _, store = make_store(tmp_path, "llama", False, num_hidden_layers=3)
    ecfg = EngineConfig(device="cpu", dtype="float32", loss_chunk=16, link_gbps=1e6, keep_activations=2)
    fo = Engine(store, ecfg, OptimConfig(kernel="torch"), forward_only=True)
    try:
        assert fo.kept_layers == 0 and fo.p.loader.kept == []
        assert not any(k.startswith("kept") for k in fo.t.memory.current)
    finally:
        fo.close()
    g = torch.Generator().manual_seed(0)
    prompts = [(i, torch.randint(3, VOCAB, (n,), generator=g).tolist()) for i, n in enumerate((3, 9, 6))]
    got = {}
    for keep in (0, 2):
        eng = Engine(store, ecfg, OptimConfig(kernel="torch", lr=1e-3), keep=keep, max_tokens=4 * 16)
        try:
            rows = random_rows(8, VOCAB, seed=3)
            res = [eng.step(micro_batches(rows[:4], 2), 1e-3)]
            eng.wait()
            out = [[c.ids for c in Decoder(eng, Sampler(), max_new_tokens=5, host_kv=h).run(prompts)]
                   for h in (False, True)]  # fmt: skip
            res.append(eng.step(micro_batches(rows[4:], 2), 1e-3))
            eng.wait()
            got[keep] = (out, [(r.loss, r.grad_norm, r.weight_loads) for r in res], engine_weights(eng))
        finally:
            eng.close()
    (out0, res0, w0), (out2, res2, w2) = got[0], got[2]
    assert out0[0] == out0[1] == out2[0] == out2[1] and all(len(ids) == 5 for ids in out0[0])
    assert [r[:2] for r in res0] == [r[:2] for r in res2]
    assert [r[2] for r in res0] == [6, 6] and [r[2] for r in res2] == [4, 4]
    assert all(torch.equal(w0[k], w2[k]) for k in w0)


def test_a_resumed_auto_run_keeps_the_k_it_began_with(tmp_path):
    """train/keep_choice.py: `auto` on resume keeps the checkpoint's K while the plan's K (the most that
    fits) is at least that, else the plan's; a number is the plan's K, recorded or not."""
    from horizon_cli.train.keep_choice import kept_layers

    ck = tmp_path / "ck"
    (ck / "state").mkdir(parents=True)
    (ck / "state" / "trainer.json").write_text(json.dumps({"kept_layers": 2}))
    quiet = Console(quiet=True)
    assert kept_layers(3, tiny_cfg("auto"), ck, None, 4, quiet) == 2
    assert kept_layers(1, tiny_cfg("auto"), ck, None, 4, quiet) == 1
    assert kept_layers(3, tiny_cfg(3), ck, None, 4, quiet) == 3
    assert kept_layers(3, tiny_cfg("auto"), None, None, 4, quiet) == 3
    console = Console(record=True, width=200)
    kept_layers(3, tiny_cfg("auto"), ck, None, 4, console)
    assert "keep_activations: 2 of 4 layers kept from forward to backward (6 layer loads per step" in (
        console.export_text()
    )


def tiny_cfg(keep) -> object:
    base = {"model": {"path": "m"}, "data": {"path": "d", "max_seq_len": 64}, "output": {"dir": "o"},
            "train": {"batch_size": 8, "micro_batch_size": 2}, "engine": {"keep_activations": keep}}  # fmt: skip
    return load_config(None, base=base)


def on_gpu(need: float) -> int:
    """The free GPU memory whose share `auto` fills (planning.transients.KEEP_MARGIN) is `need`."""
    from horizon_cli.planning.transients import KEEP_MARGIN

    return math.ceil(need / (1 - KEEP_MARGIN))


def test_auto_keeps_what_the_budget_holds(tmp_path):
    """auto: the most whole layers whose bytes fit the room the K = 0 plan leaves (a CUDA device:
    free memory less the plan and the reserve; the CPU: RAM less host and device plans and the
    reserve), none when not one fits, at most L; a number N keeps min(N, L) whatever the room."""
    _, store = make_store(tmp_path, "llama", False, num_hidden_layers=4)
    spec, L = store.arch, store.arch.n_layers
    p0 = plan_for(tiny_cfg(0), spec, "exact")
    per = sum(p0.kept_layer)
    assert p0.kept == 0 and per > 0 and p0.layers == L
    host = 1 << 40
    for n in (0, 1, 3, L, L + 2):
        where = Machine(host, on_gpu(p0.device_total + RESERVE + n * per + per // 2), "a device")
        p = plan_for(tiny_cfg("auto"), spec, "exact", where=where)
        assert p.kept == min(n, L) and p.kept_bytes == p.kept * per, n
        assert p.device_total == p0.device_total + p.kept_bytes and fit_parts(p, where)[2]
        assert p.host["saved activations"] == (L - p.kept) * p0.saved_layer
    short = Machine(host, on_gpu(p0.device_total + RESERVE + per) - 2, "a device")
    assert plan_for(tiny_cfg("auto"), spec, "exact", where=short).kept == 0
    assert plan_for(tiny_cfg("auto"), spec, "exact").kept == 0  # no machine to fit to
    tight = Machine(host, p0.device_total + RESERVE + per - 1, "a device")  # the fit check: no margin
    p2 = plan_for(tiny_cfg(2), spec, "exact", where=tight)
    assert p2.kept == 2 and not fit_parts(p2, tight)[2]  # a number is kept as given: the fit check judges it
    assert plan_for(tiny_cfg(99), spec, "exact").kept == L
    cpu = Machine(p0.node_host_total + p0.node_device_total + RESERVE + 2 * per, None, "RAM")
    assert plan_for(tiny_cfg("auto"), spec, "exact", where=cpu).kept == 2


def test_dry_run_shows_k_and_its_bytes(tiny_store, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(8))
    cfg = write_config(
        tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run", engine={"keep_activations": 0}
    )
    p0 = plan_for(load_config(cfg), Store.open(tiny_store), "exact")
    budget = on_gpu(
        p0.device_total + RESERVE + 1.5 * sum(p0.kept_layer)
    )  # room for one kept layer and a half
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(
        app, ["train", str(cfg), "engine.keep_activations=auto", "--dry-run", "--json", str(out),
              "--host-gib", "64", "--device-gib", str(budget / 2**30)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    plan = json.loads(out.read_text())
    assert (plan["kept_layers"], plan["kept_bytes"]) == (1, sum(p0.kept_layer))
    assert plan["device_bytes"] == p0.device_total + plan["kept_bytes"] and plan["fits"]
    assert plan["device"]["kept layers: graphs"] == p0.kept_layer[1]
    assert "1 of 2, 3 layer loads per step" in r.output
    # two kept layers do not fit there: the start's fit check (train/checks.py) stops the dry run
    # with its line, exit 2, after the plan is printed and written
    tight = p0.device_total + RESERVE + 1.5 * sum(p0.kept_layer)  # the fit check counts no margin
    r = CliRunner().invoke(
        app, ["train", str(cfg), "engine.keep_activations=2", "--dry-run", "--json", str(out),
              "--host-gib", "64", "--device-gib", str(tight / 2**30)],
    )  # fmt: skip
    assert r.exit_code == 2, r.output
    assert "this plan keeps 2 layers" in r.output and "engine.keep_activations" in r.output
    plan = json.loads(out.read_text())
    assert plan["kept_layers"] == 2 and not plan["fits"]


def test_bad_keep_activations_is_refused_naming_the_key():
    for bad in ("all", -1, 1.5, True):
        with pytest.raises(ConfigError, match=r"engine\.keep_activations"):
            tiny_cfg(bad)


@pytest.mark.slow
def test_killed_run_with_kept_layers_resumes_bitwise(tiny_store, tmp_path):
    """K = 1, SIGKILLed after step 3 (checkpoint at step 2), resumed with auto, which keeps the K
    the run began with: the final model bitwise that of an uninterrupted run recomputing every layer."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))

    def config(name, keep):
        return write_config(tmp_path / f"{name}.yaml", tiny_store, data, tmp_path / name,
                            engine={"keep_activations": keep})  # fmt: skip

    run_training(config("ref", 0), [], console=Console(quiet=True))
    cfg = config("kill", 1)
    env = {"HORIZON_FAULT": "after-step:3", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-m", "horizon_cli.cli", "train", str(cfg)],
                       env={**os.environ, **env}, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == -9, r.stderr[-2000:]
    assert "keep_activations: 1 of 2 layers kept" in r.stdout
    console = Console(record=True, width=200)
    run_training(config("kill", "auto"), [], console=console)
    said = console.export_text()
    assert "resuming from" in said and "keep_activations: 1 of 2 layers kept" in said
    ref, got = tmp_path / "ref" / "checkpoints" / "step_6", tmp_path / "kill" / "checkpoints" / "step_6"
    skip = {"state/config.yaml", "state/trainer.json", "checksums.json"}  # the config differs: K
    files = sorted(str(p.relative_to(ref)) for p in ref.rglob("*") if p.is_file())
    files = [f for f in files if f not in skip]
    assert (
        any(f.endswith(".m.bin") for f in files)
        and sorted(
            str(p.relative_to(got))
            for p in got.rglob("*")
            if p.is_file() and str(p.relative_to(got)) not in skip
        )
        == files
    )
    for f in files:
        assert (ref / f).read_bytes() == (got / f).read_bytes(), f
    tr = json.loads((got / "state" / "trainer.json").read_text())
    assert tr["kept_layers"] == 1
    losses = [[json.loads(x)["loss"] for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
              for n in ("ref", "kill")]  # fmt: skip
    assert losses[0] == losses[1]
