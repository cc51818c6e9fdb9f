"""The store a conversion writes: manifest, page-aligned unit buffers, checksums, opening by mmap
without reading data, copy-on-write views (invariant 7) and explicit reads into caller memory."""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from horizon_cli.convert import convert
from horizon_cli.store import ALIGN, Store, StoreWriter, layouts
from horizon_cli.store import reader as reader_mod
from tests.support.tiny import make_model, save


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def converted(request, tmp_path_factory):
    """(model, store path) for a Qwen2 model (biases, untied) in each store dtype."""
    root = tmp_path_factory.mktemp(request.param)
    model = make_model("qwen2", tie=False)
    convert(save(model, root / "src", "sharded"), root / "store", dtype=request.param)
    return model, root / "store"


def test_manifest_describes_every_tensor(converted):
    model, path = converted
    m = json.loads((path / "manifest.json").read_text())
    assert m["format"] == "horizon-store" and m["version"] == 1
    assert m["arch"]["family"] == "qwen2" and m["arch"]["qkv_bias"] is True
    assert [u["name"] for u in m["units"]] == ["embed", "layer.0", "layer.1", "head"]
    sd = model.state_dict()
    item = 2 if m["dtype"] == "bfloat16" else 4
    seen = set()
    for u in m["units"]:
        raw = (path / u["file"]).read_bytes()
        assert len(raw) == u["nbytes"] and u["nbytes"] % 4096 == 0  # whole pages
        assert u["numel"] % ALIGN == 0
        for t in u["tensors"]:
            assert t["offset"] % (ALIGN * item) == 0 and t["dtype"] == m["dtype"]
            assert t["shape"] == list(sd[t["hf"]].shape) and t["nbytes"] == sd[t["hf"]].numel() * item
            data = raw[t["offset"] : t["offset"] + t["nbytes"]]
            assert zlib.crc32(data) == t["crc32"]
            want = sd[t["hf"]].to(getattr(torch, m["dtype"])).contiguous().view(torch.uint8).numpy().tobytes()
            assert data == want, t["hf"]
            seen.add(t["hf"])
    assert seen == set(sd)
    assert m["params"] == sum(p.numel() for p in model.parameters())


def test_open_reads_no_data(converted, monkeypatch):
    """Opening is the manifest and a stat per unit: no unit byte is read or checksummed."""
    _, path = converted
    monkeypatch.setattr(reader_mod.zlib, "crc32", lambda *a: pytest.fail("open computed a checksum"))
    monkeypatch.setattr(reader_mod.np, "memmap", lambda *a, **k: pytest.fail("open mapped a unit"))
    store = Store.open(path)
    assert [u.name for u in store.units] == ["embed", "layer.0", "layer.1", "head"]


def test_views_are_copy_on_write(converted):
    """Writing through a mapped view never reaches the file (invariant 7)."""
    _, path = converted
    store = Store.open(path)
    before = (path / "units" / "layer_0000.bin").read_bytes()
    view = store.unit_view("layer.0")
    view.zero_()
    assert (path / "units" / "layer_0000.bin").read_bytes() == before
    store.verify()


def test_read_unit_matches_the_tensors(converted):
    model, path = converted
    store = Store.open(path)
    sd = model.state_dict()
    for u in store.units:
        lay = store.layout(u.name)
        out = torch.full((lay.numel,), 7.0, dtype=store.dtype)
        store.read_unit(u.name, out)
        for s in lay.slots:
            assert torch.equal(out[s.offset : s.offset + s.numel].view(s.shape), sd[s.hf].to(store.dtype))
            assert torch.equal(store.tensor(u.name, s.name), sd[s.hf].to(store.dtype))
        pad = torch.ones(lay.numel, dtype=torch.bool)
        for s in lay.slots:
            pad[s.offset : s.offset + s.numel] = False
        assert not out[pad].any()  # padding reads as zeros
    with pytest.raises(ValueError, match="out must be"):
        store.read_unit("embed", torch.empty(3, dtype=store.dtype))


def test_writer_unit_round_trip(converted, tmp_path):
    """StoreWriter.write_unit (how checkpoints are written) reproduces a store bit for bit."""
    _, path = converted
    store = Store.open(path)
    w = StoreWriter(tmp_path / "copy", store.arch, store.manifest.dtype, source="test")
    try:
        for u in store.units:
            out = torch.empty(store.layout(u.name).numel, dtype=store.dtype)
            store.read_unit(u.name, out)
            w.write_unit(u.name, out)
        w.finish(extra={"step": 3})
    finally:
        w.close()
    copy = Store.open(tmp_path / "copy")
    assert copy.manifest.extra == {"step": 3}
    for a, b in zip(store.units, copy.units, strict=True):
        assert (path / a.file).read_bytes() == (tmp_path / "copy" / b.file).read_bytes()
        assert [t.crc32 for t in a.tensors] == [t.crc32 for t in b.tensors]


def test_layouts_match_the_engine_view(converted):
    _, path = converted
    store = Store.open(path)
    assert {lay.name: lay for lay in layouts(store.arch)} == store.layouts
