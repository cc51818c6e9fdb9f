"""Sharded data parallelism (gloo on the CPU): N ranks train what one process trains.

Ranks run under torchrun in subprocesses (`--standalone`: a free port per launch), one thread
each; the one-rank references run in this process. The model test follows torchtune's: the same
global batch on 1, 2 and 3 ranks, the losses and the exported weights compared, a checkpoint
written by 2 ranks resumed on 1 and on 3, a rank SIGKILLed and the run launched again.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from horizon_cli.config.schema import LoraConfig
from horizon_cli.errors import InputError
from horizon_cli.lora.setup import lora_setup
from horizon_cli.lora.sizes import lora_memory_plan
from horizon_cli.parallel.crc import crc32_combine, crc32_of_pieces
from horizon_cli.planning.memory import MemoryPlan, memory_plan
from horizon_cli.state.host import HostState
from horizon_cli.store import Store, ckpt
from horizon_cli.train import run_training
from tests.conftest import chat_rows, store_with_tokenizer, write_config, write_jsonl

HERE = Path(__file__).parent
FP32 = {  # 10 eval rows: 5 micro-batches, dealt unevenly to 2 and to 3 ranks
    "train": {"steps": 10, "batch_size": 12, "micro_batch_size": 2, "eval_every": 5, "eval_batches": 1},
    "data": {"eval_fraction": 0.21},
    "output": {"save_every": 5, "export": True},
}


def torchrun(
    n: int, *args, fault: str = "", cli: bool = True, timeout: float = 240, script: str = "dist_train.py"
) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node n -m horizon_cli train CFG` (cli), else tests/<script> ARGS...
    In a session of its own: a run past `timeout` is killed with every rank (none left behind)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HORIZON_FAULT": fault, "HORIZON_FAULT_RANK": "1"}
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that aborts (SIGABRT, SIGSEGV) prints every thread's stack
    target = ["-m", "horizon_cli", "train"] if cli else [str(HERE / script)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *target]
    cmd += map(str, args)
    p = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def config(tmp_path: Path, store: Path, name: str, **sections) -> Path:
    data = tmp_path / "chat.jsonl"
    if not data.is_file():
        write_jsonl(data, chat_rows(48))
    sections.setdefault("engine", {}).setdefault("compute_threads", 1)
    return write_config(tmp_path / f"{name}.yaml", store, data, tmp_path / name, **sections)


def one_rank(cfg: Path) -> None:
    threads = torch.get_num_threads()
    try:
        run_training(cfg, [], console=_quiet())
    finally:
        torch.set_num_threads(threads)


def _quiet():
    from rich.console import Console

    return Console(quiet=True)


def losses(run: Path) -> list[float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows] + [r["eval_loss"] for r in rows if r.get("eval_loss") is not None]


def weights(run: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted((run / "export").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def grad_norms(run: Path) -> list[float]:
    return [json.loads(x)["grad_norm"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(ref: Path, run: Path, rel: float = 1e-5) -> None:
    """Losses, eval losses, grad norms (what clipping sees: a norm off by sqrt(world) clips
    wrongly) and the exported weights."""
    a, b = losses(ref), losses(run)
    assert len(a) == len(b) >= 10
    assert max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True)) < rel, (a, b)
    a, b = grad_norms(ref), grad_norms(run)
    assert len(a) == len(b) and max(abs(x - y) / x for x, y in zip(a, b, strict=True)) < rel, (a, b)
    wa, wb = weights(ref), weights(run)
    assert wa.keys() == wb.keys()
    for k in wa:
        err = float((wa[k].float() - wb[k].float()).norm() / wa[k].float().norm())
        assert err < rel, (k, err)


def resumable_copy(src: Path, dst: Path, cfg: Path) -> None:
    """The run dir as the kill left it (step_5), under another name, with its own config."""
    shutil.copytree(src, dst)
    c = yaml.safe_load(cfg.read_text())
    c["output"]["dir"] = str(dst)
    cfg.write_text(yaml.safe_dump(c))


@pytest.mark.slow  # 1, 2 and 3 ranks, a kill, two reshardings; the bf16 test below keeps 2 ranks = 1 fast
def test_fp32_ranks_match_one_rank_through_kill_and_resharding(tiny_store, tmp_path):
    ref = config(tmp_path, tiny_store, "ref", **FP32)
    one_rank(ref)

    # 2 ranks; rank 1 SIGKILLed in step 7: every rank stops, torchrun exits non-zero, soon. The top
    # layer kept (engine.keep_activations: 1; the others auto: every layer, or the K a resumed run
    # began with): kept or recomputed, sharded or not, the same run
    two = config(tmp_path, tiny_store, "two", **{**FP32, "engine": {"keep_activations": 1}})
    t0 = time.monotonic()
    r = torchrun(2, two, fault="step:7")
    assert r.returncode != 0, r.stdout + r.stderr
    assert time.monotonic() - t0 < 60
    assert "another rank stopped" in r.stderr or "SIGTERM" in r.stderr, r.stderr[-3000:]
    assert [p.name for p in (tmp_path / "two" / "checkpoints").iterdir()] == ["step_5"]
    assert ckpt.check(tmp_path / "two" / "checkpoints" / "step_5", deep=True) is None  # the CRCs combined
    to1, to3 = (config(tmp_path, tiny_store, n, **FP32) for n in ("to1", "to3"))
    for cfg in (to1, to3):
        resumable_copy(tmp_path / "two", tmp_path / cfg.stem, cfg)

    r = torchrun(2, two)  # launched again: resumes from the 2-rank step_5
    assert r.returncode == 0, r.stderr[-12000:]
    assert "resuming from" in r.stdout and "keep_activations: 1 of 2 layers kept" in r.stdout
    assert_same_run(tmp_path / "ref", tmp_path / "two")

    one_rank(to1)  # the 2-rank checkpoint on 1 rank
    assert_same_run(tmp_path / "ref", tmp_path / "to1")

    three = config(tmp_path, tiny_store, "three", **FP32)
    r = torchrun(3, to3, three, cli=False)  # ... on 3 ranks; and 3 ranks from the start
    assert r.returncode == 0, r.stderr[-12000:]
    assert_same_run(tmp_path / "ref", tmp_path / "to3")
    assert_same_run(tmp_path / "ref", tmp_path / "three")


def update_error(init: dict, ref: dict, run: dict) -> float:
    """|run - ref| / |ref - init| over all the weights together: 0 for the same training, ~0.5
    for a run whose updates were halved, ~1 for one that skipped them. (Per tensor, a norm scale
    that moved 1 % is dominated by the bf16 rounding of the export.)"""
    diff = sum(float((run[k].float() - ref[k].float()).square().sum()) for k in init)
    up = sum(float((ref[k].float() - w0.float()).square().sum()) for k, w0 in init.items())
    return (diff / up) ** 0.5


@pytest.fixture(scope="module")
def untied_store(tmp_path_factory) -> Path:
    """A 2-layer Llama with its own LM head (the fp32 test's store ties it to the embedding)."""
    return store_with_tokenizer(tmp_path_factory.mktemp("untied"), "llama", tie=False)


@pytest.fixture(scope="module")
def moe_store(tmp_path_factory) -> Path:
    """A 2-layer Qwen3-MoE with transformers' load-balancing loss on (output_router_logits)."""
    return store_with_tokenizer(tmp_path_factory.mktemp("moe"), "qwen3_moe", output_router_logits=True)


def aux_losses(run: Path) -> list[float]:
    return [json.loads(x)["aux_loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_bf16_exact_lean_lora_and_moe_on_two_ranks_match_one(untied_store, moe_store, tmp_path):
    tiny_store = untied_store
    base = {
        "train": {"steps": 20, "batch_size": 8, "micro_batch_size": 2},
        "output": {"save_every": 0, "export": True},
    }
    eng = {"dtype": "bfloat16", "compute_threads": 1}
    lean = {"lr": 3.0e-3, "grad_clip": 1.0, "weight_decay": 0.01, "memory": "lean"}
    # one rank keeps every layer (engine.keep_activations: auto, room to spare); two recompute them
    recompute = {"keep_activations": 0}
    cfgs = {
        name: config(
            tmp_path,
            tiny_store,
            name,
            engine={**eng, **(recompute if "2" in name else {})},
            **base,
            **({"optim": lean} if "lean" in name else {}),
        )
        for name in ("exact1", "exact2", "lean1", "lean2")
    }
    lora = {"r": 4, "alpha": 8, "dropout": 0.1}  # dropout: masks drawn per global micro-batch
    clip = {"grad_clip": 0.3}  # the adapters' norm grows from 0.15 to 0.4: clipped from step 6 on
    for name in ("lora1", "lora2"):  # fp32, the base sharded, the adapters whole on every rank
        cfgs[name] = config(
            tmp_path, tiny_store, name, lora=lora, optim=clip, engine=recompute if "2" in name else {}, **FP32
        )
    for name in ("moe1", "moe2"):  # the aux loss needs the global batch's router statistics
        cfgs[name] = config(tmp_path, moe_store, name, engine=recompute if "2" in name else {}, **FP32)
    for name in ("exact1", "lean1", "lora1", "moe1"):
        one_rank(cfgs[name])
    r = torchrun(2, cfgs["exact2"], cfgs["lean2"], cfgs["lora2"], cfgs["moe2"], cli=False)
    assert r.returncode == 0, r.stderr[-12000:]
    assert_same_run(tmp_path / "moe1", tmp_path / "moe2")
    a, b = aux_losses(tmp_path / "moe1"), aux_losses(tmp_path / "moe2")
    assert max(abs(x - y) / x for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    cfgs.pop("moe1"), cfgs.pop("moe2")
    norms = grad_norms(tmp_path / "lora1")
    assert min(norms) < clip["grad_clip"] < max(norms), norms  # the clip fires on some steps only
    assert_same_run(tmp_path / "lora1", tmp_path / "lora2")  # losses, grad norms, merged export
    a1, a2 = (load_file(tmp_path / n / "adapter" / "adapter_model.safetensors") for n in ("lora1", "lora2"))
    assert a1.keys() == a2.keys()
    for k in a1:
        assert float((a1[k] - a2[k]).norm() / a1[k].norm()) < 1e-5, k
    cfgs.pop("lora1"), cfgs.pop("lora2")
    init = load_file(tiny_store.parent / "hf" / "model.safetensors")
    w = {n: weights(tmp_path / n) for n in cfgs}
    init = {k: v for k, v in init.items() if k in w["exact1"]}
    assert update_error(init, w["exact1"], w["exact2"]) < 0.02
    assert update_error(init, w["lean1"], w["lean2"]) < 0.05  # stochastic rounding of other sums


def device_plan(case: dict, world: int) -> MemoryPlan:
    """The memory plan of a tests/parallel/dist_peak.py case, one rank's of `world`."""
    spec = Store.open(case["store"]).arch
    e = case["engine"]
    shape = dict(batch=case["batch"], micro_batch=case["micro"], seq=case["seq"])
    run = dict(prefetch=e["prefetch"], loss_chunk=e["loss_chunk"], world=world)
    if case["lora"]:
        setup = lora_setup(LoraConfig(**case["lora"]), spec)
        return lora_memory_plan(spec, setup.targets, setup.cfg.r, e["dtype"], **shape, **run)
    return memory_plan(spec, e["dtype"], **shape, **run)


def test_device_plan_covers_each_ranks_device_peak(tiny_store, untied_store, tmp_path):
    """The memory plan's device total for 2 ranks (plan.sharded_device, lora_plan's world > 1 rows)
    against the engine's own device accounting on each rank, after a step of full-length rows. On
    the CPU the engine reports its device bytes with the plan's formulas (engine/plan.py), so the
    two agree to the byte; a plan below the peak would let a run past the fit check. Full
    fine-tuning (tied fp32; untied bf16 over an emulated link: narrowed gradient copies) and LoRA
    (untied fp32; tied bf16 over the link)."""
    fp32 = {"device": "cpu", "dtype": "float32", "prefetch": 2, "loss_chunk": 16}
    bf16 = {**fp32, "dtype": "bfloat16", "link_gbps": 1e6}  # copies as on a GPU, unthrottled
    lora = {"r": 4, "alpha": 8}
    cases = [
        {"name": "full-tied", "store": str(tiny_store), "engine": fp32, "lora": None},
        {"name": "full-untied-bf16", "store": str(untied_store), "engine": bf16, "lora": None},
        {"name": "lora-untied", "store": str(untied_store), "engine": fp32, "lora": lora},
        {"name": "lora-tied-bf16", "store": str(tiny_store), "engine": bf16, "lora": lora},
    ]
    for c in cases:
        c.update(batch=4, micro=1, seq=64)  # rows of max_seq_len tokens: the plan's shapes
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    r = torchrun(2, tmp_path / "cases.json", tmp_path, cli=False, script="dist_peak.py")
    assert r.returncode == 0, r.stderr[-12000:]
    for rank in range(2):
        peaks = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for c in cases:
            plan, peak = device_plan(c, 2).device_total, peaks[c["name"]]
            assert plan == peak, (c["name"], rank, device_plan(c, 2).device, plan - peak)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype,memory", [("float32", "exact"), ("bfloat16", "exact"), ("bfloat16", "lean")])
def test_host_state_is_split_across_ranks(tiny_store, world, dtype, memory):
    """Each rank holds 1/N of every buffer (within the 64-element alignment), every element once."""
    store = Store.open(tiny_store)
    dt = getattr(torch, dtype)
    alloc = lambda n, t: torch.empty(n, dtype=t)  # noqa: E731
    whole = HostState(store, dt, alloc, memory=memory)
    total = sum(whole.nbytes().values())
    parts = [HostState(store, dt, alloc, memory=memory, shard=(world, r)) for r in range(world)]
    for p in parts:
        assert abs(sum(p.nbytes().values()) - total / world) <= 0.05 * total / world
    for name, st in whole.units.items():
        for key, buf in st.buffers().items():
            got = torch.cat([p[name].buffers()[key] for p in parts])
            assert [p[name].ranges[key][:2] for p in parts] == sorted(p[name].ranges[key][:2] for p in parts)
            if key != "grad":
                assert torch.equal(got, buf), (name, key)


def test_batch_must_split_over_the_ranks(tiny_store, tmp_path, monkeypatch):
    cfg = config(tmp_path, tiny_store, "bad", train={"batch_size": 12, "micro_batch_size": 2})
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(InputError, match="train.batch_size: 12 does not split .* on 4 ranks"):
        run_training(cfg, [], console=_quiet())
    assert not (tmp_path / "bad").exists()


def test_crc_of_pieces_is_the_crc_of_the_whole():
    """Rank 0 combines the ranks' slice checksums instead of reading the checkpoint back."""
    rng = random.Random(0)
    data = rng.randbytes(50_000)
    for _ in range(20):
        cuts = sorted({0, len(data), *rng.sample(range(1, len(data)), rng.randint(0, 6))})
        pieces = [(a, zlib.crc32(data[a:b]), b - a) for a, b in zip(cuts, cuts[1:], strict=False)]
        rng.shuffle(pieces)
        assert crc32_of_pieces(pieces) == zlib.crc32(data)
    assert crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b""), 0) == zlib.crc32(b"ab")
    with pytest.raises(ValueError, match="gap"):
        crc32_of_pieces([(0, 0, 4), (5, 0, 1)])
