"""engine.dtype: auto (runtime/dtype.py): bf16 only where the device multiplies it fast, decided once
at the start and recorded; an explicit bfloat16 where it is slow warns once; --dry-run shows it."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from horizon_cli.config import load_config
from horizon_cli.config.schema import EngineConfig
from horizon_cli.runtime import dtype as rd
from horizon_cli.store import ckpt
from tests.conftest import chat_rows, horizon, write_config, write_jsonl

SLOW = "~30x slower matrix products than fp32 on this CPU (it has no AVX-512 BF16 or AMX)"


@pytest.fixture(autouse=True)
def detected(monkeypatch):
    """The CPU's answer detected, not the suite's override (tests/conftest.py)."""
    monkeypatch.delenv(rd.FORCE, raising=False)


@pytest.fixture
def cpu_bf16(monkeypatch):
    """cpu_bf16(flags): the CPU reports these bf16 features ([]: an AVX2-only CPU)."""

    def set_(flags: list[str]):
        monkeypatch.setattr(rd, "cpu_bf16_flags", lambda: list(flags))

    return set_


@pytest.fixture
def run_cfg(tiny_store, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(16))

    def make(name="run", **engine):
        return write_config(
            tmp_path / f"{name}.yaml", tiny_store, data, tmp_path / name,
            engine={"device": "cpu", "dtype": "auto", **engine}, train={"steps": 2}, output={"save_every": 0},
        )  # fmt: skip

    return make


@pytest.mark.parametrize(
    "flags,want", [([], "float32"), (["amx_bf16"], "bfloat16"), (["avx512_bf16"], "bfloat16")]
)
def test_auto_on_the_cpu_follows_its_bf16_features(cpu_bf16, flags, want):
    cpu_bf16(flags)
    c = rd.choose(EngineConfig(device="cpu"))
    assert (c.given, c.dtype, c.fast_bf16) == ("auto", want, bool(flags))
    assert c.note is None  # auto never picks a slow bf16
    assert rd.resolve(EngineConfig(device="cpu")).dtype == want
    for given in ("bfloat16", "float32"):  # an explicit dtype is what runs
        assert rd.choose(EngineConfig(device="cpu", dtype=given)).dtype == given


@pytest.mark.parametrize("major,want", [(9, "bfloat16"), (8, "bfloat16"), (7, "float32")])
def test_auto_on_cuda_follows_the_compute_capability(monkeypatch, major, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: seen.append(i) or (major, 0))
    for device, index in (("cuda", 0), ("cuda:1", 1)):
        c = rd.choose(EngineConfig(device=device))
        assert (c.dtype, c.device, seen[-1]) == (want, device, index)
    note = rd.choose(EngineConfig(device="cuda", dtype="bfloat16")).note
    assert (note is None) == (major >= 8)
    assert note is None or "compute capability below 8.0" in note
    assert rd.choose(EngineConfig(device="cuda:2")).dtype == "float32"  # no such GPU: check_device says so


def test_a_dry_run_without_cuda_plans_a_gpu_with_native_bf16(monkeypatch):
    # planning an H200 (--device-gib) from a CPU-only machine: not the fp32 of a pre-Ampere GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    c = rd.choose(EngineConfig(device="cuda"))
    assert (c.dtype, c.fast_bf16) == ("bfloat16", True) and "no GPU here" in c.why
    assert rd.choose(EngineConfig(device="cuda", dtype="bfloat16")).note is None
    assert rd.choose(EngineConfig(device="cuda", dtype="float32")).dtype == "float32"


def test_the_cpu_features_come_from_torch_or_proc_cpuinfo(monkeypatch, tmp_path):
    caps = {"avx2": True, "avx512_bf16": False, "amx_bf16": True}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps, raising=False)
    assert rd.cpu_bf16_flags() == ["amx_bf16"]
    caps["amx_bf16"] = False
    assert rd.cpu_bf16_flags() == []
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert rd.proc_cpuinfo_flags(info) >= {"avx2", "avx512_bf16"}
    assert rd.proc_cpuinfo_flags(tmp_path / "none") == set()
    monkeypatch.delattr(torch.cpu, "get_capabilities")  # an older torch: /proc/cpuinfo's flags
    for flags, want in ((set(), []), ({"avx2", "avx512_bf16"}, ["avx512_bf16"])):
        monkeypatch.setattr(rd, "proc_cpuinfo_flags", lambda flags=flags: flags)
        assert rd.cpu_bf16_flags() == want


@pytest.mark.parametrize("flags,want", [([], "float32"), (["amx_bf16"], "bfloat16")])
def test_lean_follows_the_cpu_and_keeps_its_bf16_weight(cpu_bf16, run_cfg, tmp_path, flags, want):
    """lean decides as exact does (its bf16 weight is a storage format, upcast per layer when
    computing in fp32): the capability mocked both ways, the dry run says so and plans a bf16
    weight with bf16 gradients either way, the activations in the compute dtype."""
    cpu_bf16(flags)
    c = rd.choose(EngineConfig(device="cpu"), "lean")
    assert c.dtype == want and ("upcast per layer" in c.why) == (want == "float32")
    assert rd.grad_dtype_for("auto", c.dtype, "lean") == "bfloat16"
    assert rd.grad_dtype_for("auto", c.dtype, "exact") == c.dtype
    assert load_config(run_cfg(), ["optim.memory=lean", "engine.dtype=float32"]).engine.dtype == "float32"
    out = dry_run(run_cfg(), "optim.memory=lean", "--json", tmp_path / "p.json")
    assert f"engine.dtype: {want} (auto: " in out
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["dtype"]["dtype"] == want
    dry_run(run_cfg(), "--json", tmp_path / "e.json")
    exact = json.loads((tmp_path / "e.json").read_text())
    item = 2 if want == "bfloat16" else 4
    weights = exact["host"]["weights (streaming copy)"]  # exact streams the compute dtype
    assert plan["host"]["weights (streaming copy)"] * item == weights * 2  # lean: bf16 either way
    assert "gradients (bf16)" in plan["host"]
    assert plan["host"]["saved activations"] == exact["host"]["saved activations"]  # compute dtype's
    assert ("upcast buffers (layer, head)" in plan["device"]) == (want == "float32")


def dry_run(cfg: Path, *args):
    r = horizon("train", cfg, "--dry-run", *args)
    assert r.exit_code == 0, r.output
    return r.output


def test_dry_run_shows_the_choice_and_plans_with_it(cpu_bf16, run_cfg, tmp_path):
    cfg = run_cfg()
    cpu_bf16([])
    out = dry_run(cfg, "--json", tmp_path / "slow.json")
    assert "engine.dtype: float32 (auto: this CPU has no AVX-512 BF16 or AMX)" in out
    lines = out.splitlines()  # the printed config is the resolved one
    start = next(i for i, ln in enumerate(lines) if ln.startswith("model:"))
    end = next(i for i, ln in enumerate(lines) if "memory plan" in ln)
    assert yaml.safe_load("\n".join(lines[start:end]))["engine"]["dtype"] == "float32"
    slow = json.loads((tmp_path / "slow.json").read_text())
    assert slow["dtype"] == {"given": "auto", "dtype": "float32", "device": "cpu", "fast_bf16": False}
    assert "warning" not in out
    cpu_bf16(["amx_bf16"])
    out = dry_run(cfg, "--json", tmp_path / "fast.json")
    assert "engine.dtype: bfloat16 (auto: this CPU has amx_bf16)" in out
    fast = json.loads((tmp_path / "fast.json").read_text())
    assert fast["dtype"]["dtype"] == "bfloat16"
    # the plan is the resolved dtype's: an fp32 streaming copy (4 B a parameter) against a bf16 one
    key = "weights (streaming copy)"
    assert slow["host"][key] == 2 * fast["host"][key] > 0, (slow["host"], fast["host"])


def test_explicit_bf16_on_a_slow_cpu_warns_once(cpu_bf16, run_cfg):
    cfg = run_cfg(dtype="bfloat16")
    cpu_bf16([])
    out = dry_run(cfg)
    warns = [ln for ln in out.splitlines() if ln.startswith("warning:")]
    assert warns == [
        f"warning: engine.dtype: bfloat16 runs as asked, but {SLOW}; set engine.dtype: auto or float32 "
        "to compute in fp32 (the store is kept as it is)"
    ], out
    assert "engine.dtype: bfloat16 (as given; this CPU has no AVX-512 BF16 or AMX)" in out
    cpu_bf16(["avx512_bf16"])
    assert "warning:" not in dry_run(cfg)


def train(cfg: Path, *args) -> str:
    r = horizon("train", cfg, *args)
    assert r.exit_code == 0, r.output
    return r.output


def test_the_run_records_the_resolved_dtype_and_resumes_by_it(cpu_bf16, run_cfg, tmp_path):
    cfg = run_cfg()
    cpu_bf16([])
    train(cfg)
    run = tmp_path / "run"
    assert yaml.safe_load((run / "config.yaml").read_text())["engine"]["dtype"] == "float32"
    ck = run / "checkpoints" / "step_2"
    assert ckpt.read_trainer(ck)["dtype"] == "float32"
    assert yaml.safe_load(ckpt.read_config_text(ck) or "")["engine"]["dtype"] == "float32"
    # the same machine resolves the same: a longer run resumes it
    out = train(cfg, "train.steps=3")
    assert "resum" in out and ckpt.read_trainer(run / "checkpoints" / "step_3")["dtype"] == "float32"
    # a machine where auto means bf16: refused, saying how to resume it as it was trained
    cpu_bf16(["amx_bf16"])
    r = horizon("train", cfg, "train.steps=4")
    assert r.exit_code == 2, r.output
    line = " ".join(r.output.split())
    assert "engine.dtype: bfloat16 differs from the checkpoint's float32" in line
    assert "set engine.dtype: float32 to resume it" in line
    train(cfg, "train.steps=4", "engine.dtype=float32", "train.accept_changes=[train.steps]")


def test_auto_here_trains_as_the_dtype_it_resolves_to_bitwise(run_cfg, tmp_path):
    """On this machine (AMX, AVX-512 BF16) auto is bfloat16, and a run with it is bitwise the
    explicit bfloat16 run (elsewhere: the explicit dtype auto resolves to)."""
    want = rd.choose(EngineConfig(device="cpu")).dtype
    train(run_cfg("auto"))
    train(run_cfg("explicit", dtype=want))

    def metrics(name):
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [(m["loss"], m["grad_norm"]) for m in rows]

    assert metrics("auto") == metrics("explicit") and len(metrics("auto")) == 2
    a, b = (tmp_path / n / "checkpoints" / "step_2" for n in ("auto", "explicit"))
    assert ckpt.read_trainer(a)["dtype"] == want
    files = sorted(p.relative_to(a) for p in (a / "units").rglob("*") if p.is_file())
    files += sorted(p.relative_to(a) for p in (a / "state").glob("*.bin"))
    assert files and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def test_generation_resolves_a_named_auto(cpu_bf16, tiny_store):
    from horizon_cli.generate.model_source import open_source

    for flags, want in (([], "float32"), (["amx_bf16"], "bfloat16")):
        cpu_bf16(flags)
        assert open_source(tiny_store, {"device": "cpu", "dtype": "auto"}).engine.dtype == want
        assert open_source(tiny_store, {"device": "cpu"}).engine.dtype == "float32"  # as before on the CPU


@pytest.mark.parametrize("forced,want", [("1", "bfloat16"), ("0", "float32")])
def test_the_detection_can_be_overridden(monkeypatch, forced, want):
    """HORIZON_CPU_BF16 decides for the CPU whatever it reports (the suite sets 1: tests/conftest.py)."""
    monkeypatch.setattr(rd, "proc_cpuinfo_flags", lambda: set())
    monkeypatch.setattr(
        torch.cpu, "get_capabilities", lambda: {f: forced == "0" for f in rd.CPU_FLAGS}, raising=False
    )
    monkeypatch.setenv(rd.FORCE, forced)
    assert rd.choose(EngineConfig(device="cpu", dtype="auto")).dtype == want
