"""`horizon inspect`: architecture, parameter count, bytes per category and per parameter."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from tiny_models import make_model, save
from typer.testing import CliRunner

from horizon_cli.cli import app
from horizon_cli.convert import convert
from horizon_cli.engine.plan import memory_plan
from horizon_cli.inspect import inspect_store
from horizon_cli.store import Store

RUNNER = CliRunner(env={"COLUMNS": "160"})


@pytest.mark.parametrize(
    ("family", "tie", "flag"),
    [
        ("qwen3", True, "q/k norm"),
        ("qwen2", False, "qkv bias"),
        ("mistral", False, "sliding window 8 on 2 layers"),
    ],
)
def test_inspect_reports(tmp_path, family, tie, flag):
    model = make_model(family, tie=tie)
    convert(save(model, tmp_path / "src"), tmp_path / "store", dtype="bfloat16")
    res = RUNNER.invoke(app, ["inspect", str(tmp_path / "store"), "--verify"])
    assert res.exit_code == 0, res.stderr
    out = res.stdout
    params = sum(p.numel() for p in model.parameters())
    assert f"{family} (2 layers, hidden 32, mlp 64)" in out and f"{params:,}" in out and flag in out
    assert ("tied embeddings" in out) == tie
    for row in (
        "embedding",
        "decoder layers",
        "head",
        "AdamW moments (fp32)",
        "master remainder (int16)",
        "B/param",
    ):
        assert row in out, row
    assert "verified" in out and "tensor checksums" in out


def test_inspect_numbers(tmp_path):
    model = make_model("llama", tie=False)
    convert(save(model, tmp_path / "src"), tmp_path / "store", dtype="float32")
    info = inspect_store(tmp_path / "store", console=Console(file=io.StringIO()))
    assert info["params"] == sum(p.numel() for p in model.parameters())
    assert info["bytes"] >= 4 * info["params"] and info["bytes"] % 4096 == 0
    # the figures are the engine's memory plan for this architecture (padding included)
    arch = Store.open(tmp_path / "store").arch
    for dtype, b in info["bytes_per_param"].items():
        assert b == memory_plan(arch, dtype, batch=0).bytes_per_param and 12 <= b < 20
