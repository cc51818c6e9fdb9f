"""Write tests/fixtures/nf4-legacy/: NF4 stores as horizon wrote them before the bitsandbytes layout
(manifest versions 3 and 4, torchao's NF4Tensor arithmetic), with the dequantized tensors' SHA-256.

    PYTHONPATH=<checkout at 669754a (or any commit before store version 5)>:<this checkout> \
        .venv/bin/python scripts/nf4_legacy_fixtures.py tests/fixtures/nf4-legacy

(run by its path, not with -m: the older checkout's horizon_cli must come first on the path, this
checkout's root second, for tests.support)

It must run against an older horizon: the current one writes version 5. tests/quant/test_nf4_legacy.py
opens the stores with the current horizon and checks that every tensor dequantizes to exactly the
bytes the older horizon gave (`expected.json`, written here by that older horizon's Store.tensor).

    v4-llama/     `convert --quantize nf4 --dtype bfloat16` of a tiny Llama (version 4)
    v3-mixtral/   a tiny Mixtral as version 3 wrote it: routers NF4 too (`packed.kept` empty)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch

from horizon_cli.convert import convert
from horizon_cli.store import Store, packed
from tests.support.tiny import make_model, save


def digest(store: Store) -> dict[str, str]:
    out = {}
    for u in store.units:
        for s in store.layout(u.name).slots:
            t = store.tensor(u.name, s.name).contiguous()
            out[f"{u.name}/{s.name}"] = hashlib.sha256(
                t.reshape(-1).view(torch.uint8).numpy().tobytes()
            ).hexdigest()
    return out


def build(tmp: Path, family: str, dst: Path, version: int) -> None:
    """Convert a tiny model with the running horizon, store it as `version`, record its tensors."""
    model = make_model(family)
    save(model, tmp / "hf")
    keep = packed.kept
    if version == 3:  # before routers and biases were kept in the store dtype
        packed.kept = lambda spec, lay: frozenset()
    try:
        convert(tmp / "hf", tmp / "store", dtype="bfloat16", quantize="nf4")
    finally:
        packed.kept = keep
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(tmp / "store", dst)
    man = dst / "manifest.json"
    m = json.loads(man.read_text())
    man.write_text(json.dumps({**m, "version": version, "source": ""}, indent=1))
    store = Store.open(dst)  # read back as that horizon reads the version
    (dst / "expected.json").write_text(json.dumps(digest(store), indent=1, sort_keys=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as t:
        build(Path(t) / "llama", "llama", a.out / "v4-llama", 4)
        build(Path(t) / "mixtral", "mixtral", a.out / "v3-mixtral", 3)
    for d in ("v4-llama", "v3-mixtral"):
        m = json.loads((a.out / d / "manifest.json").read_text())
        print(d, "version", m["version"], m["created_by"])


if __name__ == "__main__":
    main()
