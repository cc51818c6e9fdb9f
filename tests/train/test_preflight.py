"""Checks before work starts: the device exists (train, --dry-run, profile), the memory plan is
judged against RLIMIT_AS and the cgroup's limit, `--dry-run` runs every check a real start runs
and writes nothing, `profile` checks its output paths before measuring."""

from __future__ import annotations

import json
import resource

import pytest
import torch

from horizon_cli import preflight
from tests.conftest import chat_rows, horizon, write_config, write_jsonl


def error_line(r, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.output
    return lines[0]


@pytest.fixture
def cfg(tiny_store, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    return write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run", train={"steps": 1})


def missing_gpu() -> str:
    """A CUDA device this machine does not have."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize("how", [["train"], ["train", "--dry-run"], ["profile"]])
def test_a_missing_gpu_is_bad_input_everywhere(cfg, tmp_path, how):
    args = [how[0], cfg, f"engine.device={missing_gpu()}", *how[1:]]
    if how[0] == "profile":  # profile takes no overrides: the device goes into its config
        cfg.write_text(cfg.read_text().replace("device: cpu", f"device: '{missing_gpu()}'"))
        args = ["profile", cfg]
    assert "engine.device" in error_line(horizon(*args))
    assert not (tmp_path / "run").exists()


def test_dry_run_checks_the_data_and_positions_and_writes_nothing(cfg, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"nothing": "here"}])
    assert "bad.jsonl" in error_line(horizon("train", cfg, f"data.path={bad}", "--dry-run"))
    assert "max_seq_len" in error_line(horizon("train", cfg, "data.max_seq_len=4096", "--dry-run"))
    r = horizon("train", cfg, "--dry-run", f"data.cache_dir={tmp_path / 'cache'}")
    assert r.exit_code == 0, r.output
    assert "a new run" in r.output and "fits" in r.output
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_dry_run_refuses_a_resume_with_changed_settings(cfg, tmp_path):
    assert horizon("train", cfg).exit_code == 0
    msg = error_line(horizon("train", cfg, "train.seed=7", "train.steps=2", "--dry-run"))
    assert "train.seed 1 -> 7" in msg
    assert "resumes from step_1" in horizon("train", cfg, "train.steps=2", "--dry-run").output


@pytest.mark.parametrize("opt", ["--json", "--trace", "--plot"])
def test_profile_checks_its_output_paths_before_measuring(tmp_path, monkeypatch, opt):
    from horizon_cli.profile import run as prof

    def never(*a, **kw):
        raise AssertionError("measured before checking the output paths")

    monkeypatch.setattr(prof, "_setup", never)
    msg = error_line(horizon("profile", opt, tmp_path / "no" / "such" / "dir" / "out"))
    assert opt in msg and "does not exist" in msg
    (tmp_path / "adir").mkdir()
    assert "is a directory" in error_line(horizon("profile", opt, tmp_path / "adir"))


def test_cgroup_limits_v2_and_v1(tmp_path):
    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "memory.max").write_text("8589934592\n")
    (root / "a" / "memory.current").write_text("1073741824\n")
    (root / "a" / "b" / "memory.max").write_text("max\n")
    (root / "a" / "b" / "memory.current").write_text("5\n")
    (root / "memory" / "x").mkdir(parents=True)
    (root / "memory" / "x" / "memory.limit_in_bytes").write_text("4294967296\n")
    (root / "memory" / "x" / "memory.usage_in_bytes").write_text("294967296\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    (root / "memory" / "memory.usage_in_bytes").write_text("1\n")
    me = tmp_path / "cgroup"
    me.write_text("0::/a/b\n4:memory:/x\n1:cpu:/\n")
    got = preflight.cgroup_headroom(root, me)
    assert [g[0] for g in got] == [8589934592 - 1073741824, 4294967296 - 294967296]
    assert "memory.max" in got[0][1] and "memory.limit_in_bytes" in got[1][1]


def test_the_fit_check_honours_rlimit_as(cfg, monkeypatch):
    real = resource.getrlimit

    def small(which):
        return (1 << 20, resource.RLIM_INFINITY) if which == resource.RLIMIT_AS else real(which)

    monkeypatch.setattr(resource, "getrlimit", small)
    avail, what = preflight.host_available()
    assert avail == 0 and "RLIMIT_AS" in what  # torch alone maps more than 1 MiB
    msg = error_line(horizon("train", cfg))
    assert "does not fit" in msg and "RLIMIT_AS" in msg
    assert "does not fit" in horizon("train", cfg, "--dry-run").output


def _tensorboard_missing(monkeypatch, tmp_path, request):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # `import` raises ImportError
    return ["log.tensorboard=true"]


def _small_host(monkeypatch, tmp_path, request):
    monkeypatch.setattr(preflight, "host_available", lambda: (1 << 20, "test limit"))
    return []


def _small_host_and_bad_data(monkeypatch, tmp_path, request):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"nothing": "here"}])
    return [*_small_host(monkeypatch, tmp_path, request), f"data.path={bad}"]  # the fit is checked first


def _in_use(monkeypatch, tmp_path, request):
    from horizon_cli import owner

    (tmp_path / "run").mkdir()
    request.addfinalizer(owner.DirLock.acquire(tmp_path / "run").release)  # as a running start holds it
    return []


def _not_a_directory(monkeypatch, tmp_path, request):
    (tmp_path / "run").write_text("a file")
    return []


def _no_native_kernel(monkeypatch, tmp_path, request):
    from horizon_cli.optim import native

    monkeypatch.setattr(native, "needs_build", lambda: False)
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "reason", lambda: "no C++ compiler ('c++' not on PATH)")
    return ["optim.kernel=native"]


def _bad_data(monkeypatch, tmp_path, request):
    return [f"data.path={write_jsonl(tmp_path / 'bad.jsonl', [{'nothing': 'here'}])}"]


@pytest.mark.parametrize(
    "fault,needle",
    [
        (_small_host, "does not fit"),
        (_small_host_and_bad_data, "does not fit"),
        (_tensorboard_missing, "log.tensorboard: needs the tensorboard package"),
        (_in_use, "is in use by PID"),
        (_not_a_directory, "is not a directory"),
        (_bad_data, "bad.jsonl"),
        (_no_native_kernel, "optim.kernel: native AdamW kernel unavailable (no C++ compiler"),
    ],
    ids=["no-fit", "no-fit-and-bad-data", "tensorboard", "in-use", "not-a-dir", "bad-data", "native-kernel"],
)
def test_a_dry_run_stops_where_the_start_stops_with_its_line(
    cfg, tmp_path, monkeypatch, request, fault, needle
):
    """The same checks in the same order (train/checks.py): the dry run prints and writes its
    plan, then exits 2 with exactly the line the start gives, and writes nothing else."""
    over = fault(monkeypatch, tmp_path, request)
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "plan.json"
    dry = horizon("train", cfg, *over, "--dry-run", "--json", out)
    line = error_line(dry)
    assert needle in line
    assert "memory plan" in dry.output and json.loads(out.read_text())["ladder"]
    out.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written but the plan
    assert error_line(horizon("train", cfg, *over)) == line
