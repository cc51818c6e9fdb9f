"""The native AdamW kernel's first-time build: a build killed midway never makes later runs wait,
and a build that cannot finish falls back to the torch optimizer with a warning."""

from __future__ import annotations

import types

import pytest
from typer.testing import CliRunner

from horizon_cli import owner
from horizon_cli.cli import app
from horizon_cli.optim import kernel, native
from tests.conftest import chat_rows, write_config, write_jsonl


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty kernel cache and no kernel loaded in this process yet."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_reason", None)
    return tmp_path / "ext" / "horizon"


def test_a_killed_build_leaves_nothing_to_wait_on(fresh, monkeypatch):
    name = native._module_name()
    me = owner.me()
    killed = fresh / f".{name}.build-{me.host}-{me.boot}-{me.pid}-{me.start + 1}-abcdef"  # a dead owner
    (killed / "build.ninja").parent.mkdir(parents=True)
    (killed / "lock").write_text("")  # torch's build lock, held by nobody now
    old = fresh / name  # an older layout built in place; killed before it finished
    old.mkdir()
    (old / "lock").write_text("")
    (old / f"{name}.so").write_bytes(b"\x7fELF half")
    built = []

    def compile_(n, build):
        assert build.parent == fresh and build.name.startswith(f".{name}.build-")  # private
        assert not (build / "lock").exists()
        (build / f"{n}.so").write_bytes(b"library")
        built.append(build)
        return types.SimpleNamespace(name=n)

    monkeypatch.setattr(native, "_compile", compile_)
    module = native._load()
    assert module.name == name and len(built) == 1
    assert sorted(p.name for p in fresh.iterdir()) == [name]  # the killed build swept
    assert sorted(p.name for p in old.iterdir()) == sorted([native.DONE, f"{name}.so"])
    assert (old / f"{name}.so").read_bytes() == b"library"


def test_a_build_that_cannot_finish_falls_back_to_torch_with_a_warning(
    fresh, tiny_store, tmp_path, monkeypatch
):
    def compile_(n, build):
        raise RuntimeError("ninja: build stopped: interrupted by user.")

    monkeypatch.setattr(native, "_compile", compile_)
    assert not native.available() and "interrupted" in native.reason()
    impl, name, note = kernel.pick_kernel("auto")
    assert name == "torch" and "unavailable" in note
    assert [p.name for p in fresh.iterdir()] == []  # its private build dir is gone too
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    cfg = write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run", train={"steps": 1})
    r = CliRunner().invoke(app, ["train", str(cfg), "optim.kernel=auto"], env={"COLUMNS": "2000"})
    assert r.exit_code == 0, r.output
    assert "warning: native AdamW kernel unavailable, using the torch path" in r.output


def test_the_first_build_is_a_phase_of_its_own_before_the_weights_load(
    fresh, tiny_store, tmp_path, monkeypatch
):
    """The one-time build is shown as its own phase (a line, a spinner on a terminal) before the
    weights load, never inside the first step (it once showed as `5 tok/s 99.76 s/step`)."""
    from horizon_cli.optim.adamw import AdamWHyper, adamw_fp32_

    def compile_(n, build):  # the library a build makes, here the torch reference with its calls
        (build / f"{n}.so").write_bytes(b"library")
        return types.SimpleNamespace(
            adamw_fp32=lambda p, g, m, v, *s, isa: adamw_fp32_(p, g, m, v, AdamWHyper(*s))
        )

    monkeypatch.setattr(native, "_compile", compile_)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    cfg = write_config(tmp_path / "cfg.yaml", tiny_store, data, tmp_path / "run", train={"steps": 1})
    r = CliRunner().invoke(app, ["train", str(cfg)], env={"COLUMNS": "2000"})
    assert r.exit_code == 0, r.output
    order = ["native AdamW kernel: building it", "native AdamW kernel: built in", "load weights",
             "AdamW kernel native", "step     1/1"]  # fmt: skip
    at = [r.output.find(s) for s in order]
    assert -1 not in at and at == sorted(at), r.output
    r = CliRunner().invoke(app, ["train", str(cfg), "train.steps=2"], env={"COLUMNS": "2000"})
    assert r.exit_code == 0 and "native AdamW kernel: build" not in r.output, r.output  # built: no phase


@pytest.mark.slow
def test_a_real_build_killed_midway_then_built_again(tmp_path):
    """The real compiler, killed a few seconds into its first build; the next build finishes."""
    import os
    import subprocess
    import sys
    import time

    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    code = "from horizon_cli.optim import native; print(native.available(), native.reason())"
    p = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    root = tmp_path / "horizon"
    deadline = time.monotonic() + 60
    while not any(root.glob(f".{native._module_name()}.build-*/build.ninja")):  # compiling now
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.2)
    time.sleep(2)
    os.killpg(p.pid, 9)  # the build and its compiler processes
    p.wait()
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.stdout.startswith("True"), r.stdout + r.stderr
    assert sorted(q.name for q in root.iterdir()) == [native._module_name()]
