"""`horizon inspect`: architecture, parameter count, bytes per category and per parameter."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

from horizon_cli.cli import app
from horizon_cli.convert import convert
from horizon_cli.inspect import inspect_store
from horizon_cli.store import Store
from tests.support.tiny import make_model, save

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
    """inspect's figures against what is really there: the unit files on disk, and the host
    buffers an engine allocates for training (not the memory plan inspect itself reads)."""
    from horizon_cli.config.schema import EngineConfig, OptimConfig
    from horizon_cli.engine import Engine

    model = make_model("llama", tie=False)
    convert(save(model, tmp_path / "src"), tmp_path / "store", dtype="float32")
    out = io.StringIO()
    info = inspect_store(tmp_path / "store", console=Console(file=out, width=200))
    params = sum(p.numel() for p in model.parameters())
    assert info["params"] == params
    assert info["bytes"] == sum(f.stat().st_size for f in (tmp_path / "store" / "units").iterdir())
    store = Store.open(tmp_path / "store")
    numel = sum(store.layout(u.name).numel for u in store.units)  # padded to the unit alignment
    for dtype, per_elem in (("bfloat16", 2 + 2 + 8 + 2), ("float32", 4 + 4 + 8)):
        eng = Engine(store, EngineConfig(device="cpu", dtype=dtype), OptimConfig(kernel="torch"))
        try:
            allocated = sum(eng.host.nbytes().values())
            really = sum(
                t.untyped_storage().nbytes() for st in eng.host.units.values() for t in st.buffers().values()
            )
        finally:
            eng.close()
        assert allocated == really  # nbytes() counts the buffers that exist
        # an untied table's gradient holds the rows a step touches (compact, fp32; sized by the
        # step's tokens, as activations are: none before a step, none in inspect's batch=0 plan)
        embed = store.layout("embed").numel
        expected = per_elem * numel - (2 if dtype == "bfloat16" else 4) * embed
        assert really == expected, dtype
        assert info["bytes_per_param"][dtype] == pytest.approx(really / params, rel=1e-12), dtype
    # the host table's last row: "B/param | <bf16> | <fp32>"
    printed = re.findall(r"B/param\W+([\d.]+)\W+([\d.]+)", out.getvalue())
    assert printed == [tuple(f"{info['bytes_per_param'][d]:.2f}" for d in ("bfloat16", "float32"))]
