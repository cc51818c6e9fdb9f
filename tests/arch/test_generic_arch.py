"""The generic architecture as typed data (arch.generic_arch): manifests written before it had a
version read into the same dataclasses, write back the JSON they held (model fingerprints, and so
resuming runs, unchanged), and a newer version is refused.

tests/fixtures/generic-arch-v0.json holds the `arch` section of stores converted by horizon
c506a08 (before the version): tiny Mixtral (routing), Dory (a loop's junctions), DeepSeek-V4
(residual streams, an integer buffer), Gemma 4 (side inputs), Sarvam-MoE (a split disk tensor:
`after`) and Qwen3-Next (a measured recurrent mixer)."""

import hashlib
import json
from pathlib import Path

import pytest

from horizon_cli.arch import ArchSpec
from horizon_cli.arch.generic_arch import VERSION, GenericArch, TensorRow
from horizon_cli.arch.structure import Stack
from horizon_cli.store.manifest import read_manifest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
OLD = json.loads((FIXTURES / "generic-arch-v0.json").read_text())


def _hash(d: dict) -> str:
    """What store.ckpt.model_fingerprint hashed of the architecture before the version."""
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("mt", sorted(OLD))
def test_an_unversioned_arch_reads_and_writes_back_as_it_was(mt):
    old = OLD[mt]
    spec = ArchSpec.from_dict(old)
    assert isinstance(spec.generic, GenericArch) and spec.generic.version == 0
    assert spec.to_dict(versioned=False) == old
    assert _hash(spec.to_dict(versioned=False)) == _hash(old)
    new = spec.to_dict()
    assert new["generic"]["version"] == VERSION
    again = ArchSpec.from_dict(json.loads(json.dumps(new)))
    assert again == spec and again.generic is not None and again.generic.version == VERSION


def test_the_fields_are_typed():
    g = ArchSpec.from_dict(OLD["dory"]).generic
    assert g is not None and isinstance(g.model, Stack)
    assert g.model.calls == (0, 1, 2, 1, 2, 3)
    assert g.model.junctions == {1: (0,), 3: (0, 2)}
    assert all(isinstance(r, TensorRow) for r in g.units.embed + g.units.head)
    v4 = ArchSpec.from_dict(OLD["deepseek_v4"])
    assert v4.generic is not None and v4.generic.boundary == ("b", "T", 4, 64)
    assert v4.boundary(2, 3) == (2, 3, 4, 64) and v4.tokens_dim == 1
    assert any(r.dtype for rows in v4.generic.kinds.values() for r in rows)
    sarvam = ArchSpec.from_dict(OLD["sarvam_moe"]).generic
    assert sarvam is not None and sarvam.moe is not None
    assert any(r.after for rows in sarvam.kinds.values() for r in rows)
    gemma = ArchSpec.from_dict(OLD["gemma4_text"]).generic
    assert gemma is not None and gemma.model is not None and gemma.model.side
    nxt = ArchSpec.from_dict(OLD["qwen3_next"]).generic
    assert nxt is not None and set(nxt.workset["k0"].saved) == {"float32", "bfloat16"}


def test_the_architecture_is_frozen():
    g = ArchSpec.from_dict(OLD["mixtral"]).generic
    with pytest.raises(AttributeError):
        g.moe = None  # type: ignore[misc]


def test_a_store_from_before_the_probe_writes_back_as_it_was():
    """tests/fixtures/nf4-legacy's Mixtral: no `model`, `class`, `carried`, ... and the pre-probe
    keys (`masks`, `rope`, `softcap`, `embed_scale`, ...)."""
    m = json.loads((FIXTURES / "nf4-legacy" / "v3-mixtral" / "manifest.json").read_text())
    spec = read_manifest(FIXTURES / "nf4-legacy" / "v3-mixtral").arch
    g = spec.generic
    assert g is not None and g.model is None and g.cls is None and g.carried == ()
    assert g.moe is not None and g.moe.layers == (0, 1)
    assert spec.to_dict(versioned=False) == m["arch"]


def test_a_newer_version_is_refused(tmp_path):
    d = json.loads(json.dumps(OLD["mixtral"]))
    d["generic"]["version"] = VERSION + 1
    with pytest.raises(ValueError, match="version"):
        ArchSpec.from_dict(d)


def test_a_store_without_the_version_keeps_its_fingerprint(tmp_path):
    """A store converted before the version (its manifest as today's less `version`) opens, and its
    model fingerprint — what a run dir and a LoRA export check — is the versioned store's."""
    import torch

    from horizon_cli.convert import convert
    from horizon_cli.store import Store
    from horizon_cli.store.ckpt import model_fingerprint
    from tests.support.census_config import build, tiny_config

    torch.manual_seed(0)
    build("mixtral", tiny_config("mixtral", 2)).float().save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", dtype="float32")
    path = tmp_path / "store" / "manifest.json"
    m = json.loads(path.read_text())
    assert m["arch"]["generic"]["version"] == VERSION
    before = model_fingerprint(Store.open(tmp_path / "store"))
    del m["arch"]["generic"]["version"]
    path.write_text(json.dumps(m, indent=1))
    old = Store.open(tmp_path / "store")
    assert old.arch.generic is not None and old.arch.generic.version == 0
    assert model_fingerprint(old) == before


def _disk(g: GenericArch) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes, as the table's parts name them."""
    out = {p.hf: p.shape for r in g.units.embed + g.units.head for p in r.parts}
    for i in range(len(g.layer_kinds)):
        out.update({p.hf: p.shape for r in g.layer_table(i) for p in r.at_layer(i).parts})
    return out


@pytest.mark.parametrize("mt", sorted(OLD))
def test_an_unversioned_arch_reads_as_todays_description(mt):
    """What a store converted before holds reads into the dataclasses today's convert derives
    (the measured mixer's bytes aside: the saved-tensor count of a meta run varies)."""
    from dataclasses import replace

    from horizon_cli.arch.spec import spec_from_hf

    old = ArchSpec.from_dict(OLD[mt])
    assert old.generic is not None
    now = spec_from_hf(dict(old.generic.config), disk=_disk(old.generic), path="generic")
    assert now.generic is not None
    assert {k: m.module for k, m in now.generic.workset.items()} == {
        k: m.module for k, m in old.generic.workset.items()
    }
    assert replace(now, generic=replace(now.generic, workset={})) == replace(
        old, generic=replace(old.generic, workset={})
    )
