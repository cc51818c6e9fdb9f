"""`horizon export`: shards and index, run dirs (latest checkpoint), replacing a destination."""

from __future__ import annotations

import importlib
import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file
from typer.testing import CliRunner

from horizon_cli.cli import app
from horizon_cli.convert import convert
from horizon_cli.errors import InputError
from horizon_cli.export import export, resolve_source
from tests.support.tiny import make_model, save

# the module, not the function the package re-exports under the same name
EXPORT_MOD = importlib.import_module("horizon_cli.export.export")

RUNNER = CliRunner()


@pytest.fixture(scope="module")
def model():
    return make_model("mistral", tie=False)


@pytest.fixture
def store(model, tmp_path):
    convert(save(model, tmp_path / "src"), tmp_path / "store", dtype="float32")
    return tmp_path / "store"


def test_many_shards(store, model, tmp_path, monkeypatch):
    monkeypatch.setattr(EXPORT_MOD, "SHARD_BYTES", 20_000)
    info = export(store, tmp_path / "dst")
    files = sorted((tmp_path / "dst").glob("model-*.safetensors"))
    assert info["shards"] == len(files) > 3
    assert all(f.name.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    index = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())
    total = 0
    for f in files:
        sd = load_file(f)
        assert all(index["weight_map"][k] == f.name for k in sd)
        total += sum(v.numel() * v.element_size() for v in sd.values())
    assert index["metadata"]["total_size"] == total
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dst")
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_run_dir_exports_its_latest_checkpoint(store, tmp_path):
    """A run dir's checkpoints/step_N is a store (plus state/); export takes the newest complete one."""
    from horizon_cli.store.ckpt import write_sums

    run = tmp_path / "run"
    for step in (2, 10, 4, 14):
        shutil.copytree(store, run / "checkpoints" / f"step_{step}")
        (run / "checkpoints" / f"step_{step}" / "state").mkdir()
        (run / "checkpoints" / f"step_{step}" / "state" / "trainer.json").write_text("{}")
        write_sums(run / "checkpoints" / f"step_{step}", {})
    shutil.copytree(store, run / "checkpoints" / ".step_12.tmp-x")  # a half-written one: ignored
    (run / "checkpoints" / "step_11").mkdir()  # no checksums file: not complete
    shutil.copytree(store, run / "checkpoints" / "step_13")  # no checksums file: not complete
    (run / "checkpoints" / "step_14" / "state" / "trainer.json").write_text("{} ")  # damaged
    assert resolve_source(run) == run / "checkpoints" / "step_10"
    res = RUNNER.invoke(app, ["export", str(run), str(tmp_path / "dst")])
    assert res.exit_code == 0, res.stderr
    assert "step_10" in res.stderr
    assert (tmp_path / "dst" / "config.json").is_file()


def test_run_dir_without_checkpoints(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(InputError, match="no complete checkpoint"):
        resolve_source(tmp_path / "run")


def test_force_replaces_export(store, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "stale.safetensors").write_text("old")
    res = RUNNER.invoke(app, ["export", str(store), str(dst), "--force"])
    assert res.exit_code == 0, res.stderr
    assert not (dst / "stale.safetensors").exists() and (dst / "model.safetensors.index.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".dst")] == []


def test_store_without_config(store, tmp_path):
    (store / "hf" / "config.json").unlink()
    res = RUNNER.invoke(app, ["export", str(store), str(tmp_path / "dst")])
    assert res.exit_code == 2 and "hf/config.json: missing" in res.stderr
    assert not (tmp_path / "dst").exists()


def test_dst_inside_is_refused(store):
    res = RUNNER.invoke(app, ["export", str(store), str(store.parent), "--force"])
    assert res.exit_code == 2 and "would replace the source" in res.stderr
    assert (store / "manifest.json").is_file()
