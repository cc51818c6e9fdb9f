"""NF4 stores written before the bitsandbytes layout (manifest versions 3 and 4) still open, check,
dequantize and train exactly as they were written: tests/fixtures/nf4-legacy holds two, made by
horizon 669754a (scripts/nf4_legacy_fixtures.py), with the SHA-256 of every tensor as that horizon
dequantized it."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from horizon_cli.errors import InputError
from horizon_cli.quant import nf4
from horizon_cli.state.frozen import FrozenState
from horizon_cli.store import Store

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nf4-legacy"


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("name,version", [("v4-llama", 4), ("v3-mixtral", 3)])
def test_an_older_store_dequantizes_as_it_was_written(name, version):
    store = Store.open(FIXTURES / name)
    assert store.manifest.version == version and {p.scheme for p in store.packed.values()} == {"torchao"}
    store.verify()
    want = json.loads((FIXTURES / name / "expected.json").read_text())
    got = {
        f"{u.name}/{s.name}": sha(store.tensor(u.name, s.name))
        for u in store.units
        for s in store.layout(u.name).slots
    }
    assert got == want
    # the engine's path: the frozen base dequantizes the packed bytes into the dense layout (it
    # names no scheme: the region's length tells it)
    base = FrozenState(store, store.dtype, lambda n, dt: torch.empty(n, dtype=dt))
    for u, st in base.units.items():
        if st.packed is not None:
            dense = torch.zeros(st.layout.numel, dtype=store.dtype)
            base.dequantize(u, st.stream, dense)
            for s in store.layout(u).slots:
                assert sha(dense[s.offset : s.offset + s.numel]) == want[f"{u}/{s.name}"], (u, s.name)
    assert json.loads(store.manifest.to_json())["version"] == version  # rewritten as it was read


def test_lora_trains_on_an_older_store(tmp_path):
    from horizon_cli.config.schema import EngineConfig, LoraConfig, OptimConfig
    from horizon_cli.engine import Engine
    from horizon_cli.lora.setup import lora_setup
    from tests.support.oracle import micro_batches, random_rows

    store = Store.open(FIXTURES / "v4-llama")
    eng = Engine(
        store,
        EngineConfig(device="cpu", dtype="float32", loss_chunk=16),
        OptimConfig(kernel="torch", lr=1e-3),
        lora=lora_setup(LoraConfig(r=2, alpha=4, targets=["q_proj", "down_proj"]), store.arch),
    )
    try:
        mbs = micro_batches(random_rows(4, store.arch.vocab), 2)
        losses = [eng.step(mbs, 1e-3).loss for _ in range(3)]
        eng.wait()
    finally:
        eng.close()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_a_version_3_store_is_not_read_as_version_4(tmp_path):
    """Version 3 holds the routers in NF4 too; read as version 4 its layout does not match."""
    shutil.copytree(FIXTURES / "v3-mixtral", tmp_path / "s")
    man = tmp_path / "s" / "manifest.json"
    man.write_text(json.dumps({**json.loads(man.read_text()), "version": 4}))
    with pytest.raises(InputError, match="does not match its architecture's layout"):
        Store.open(tmp_path / "s")


def test_an_older_store_relabelled_as_version_5_is_refused(tmp_path):
    """The scheme is the manifest's: the same bytes read as bitsandbytes' layout do not fit."""
    shutil.copytree(FIXTURES / "v4-llama", tmp_path / "s")
    man = tmp_path / "s" / "manifest.json"
    man.write_text(json.dumps({**json.loads(man.read_text()), "version": 5}))
    with pytest.raises(InputError, match="does not match its architecture's layout"):
        Store.open(tmp_path / "s")


def test_the_region_length_tells_the_scheme():
    for numel in (64, 4096, 256 * 64, 256 * 64 * 3 + 64):
        for item in (2, 4):
            bnb, old = nf4.nbytes(numel, item, "bnb"), nf4.nbytes(numel, item, "torchao")
            assert bnb > old  # the dynamic map and fp32 scales: never the same length
            assert nf4.scheme_of_region(bnb, numel, item) == "bnb"
            assert nf4.scheme_of_region(old, numel, item) == "torchao"


def test_inspect_names_the_older_layout():
    from rich.console import Console

    from horizon_cli.inspect import inspect_store

    console = Console(record=True, width=300)
    info = inspect_store(FIXTURES / "v4-llama", verify=True, console=console)
    assert info["quant_scheme"] == "torchao"
    assert (
        "as NF4 (horizon's layout before store version 5, torchao's arithmetic: convert again for bitsandbytes')"
        in (console.export_text())
    )


def test_a_manifest_whose_version_and_quantization_disagree_is_corrupt(tmp_path):
    shutil.copytree(FIXTURES / "v4-llama", tmp_path / "s")
    man = tmp_path / "s" / "manifest.json"
    d = json.loads(man.read_text())
    del d["quant"]
    man.write_text(json.dumps(d))
    with pytest.raises(InputError) as e:
        Store.open(tmp_path / "s")
    assert str(e.value) == f"{man}: corrupt manifest (format version 4 and quantization '' disagree)"
