"""The store manifest: format version, architecture, and the per-unit tensor table.

See docs/store-format.md. The manifest is the only thing read to open a store; unit files are
raw little-endian tensors at the byte offsets it lists.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..arch import ArchSpec
from ..errors import InputError

FORMAT = "horizon-store"
VERSION = 1  # native architectures
VERSION_GENERIC = 2  # `arch` carries the generic path's tensor table (arch.generic)
VERSION_QUANT = 5  # decoder layers are packed: NF4 linear weights as bitsandbytes (`quant`, store.packed)
VERSION_QUANT_V4 = 4  # the same in horizon's earlier NF4 layout (torchao's arithmetic): read only
VERSION_QUANT_V3 = 3  # as 4, from before routers and biases were kept (store.packed.kept): read only
QUANT_VERSIONS = (VERSION_QUANT_V3, VERSION_QUANT_V4, VERSION_QUANT)
READABLE = (VERSION, VERSION_GENERIC, *QUANT_VERSIONS)
MANIFEST = "manifest.json"

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_NAMES = {t: name for name, t in DTYPES.items()}  # torch dtype -> its manifest name
QUANTS = ("", "nf4")


@dataclass
class TensorEntry:
    name: str
    hf: str
    dtype: str  # the store dtype, or "nf4" for a quantized tensor (its parts: quant/nf4.py)
    shape: list[int]
    offset: int  # bytes from the start of the unit file
    nbytes: int
    crc32: int


@dataclass
class UnitEntry:
    name: str
    file: str  # relative to the store root
    numel: int  # padded element count of the flat buffer
    nbytes: int  # file size (page padded)
    tensors: list[TensorEntry]


@dataclass
class Manifest:
    dtype: str
    arch: ArchSpec
    units: list[UnitEntry]
    params: int
    source: str = ""
    created_by: str = ""
    format: str = FORMAT
    version: int = VERSION
    extra: dict = field(default_factory=dict)
    quant: str = ""  # "" or "nf4": decoder layers packed, linear weights in NF4 (store.packed)

    def unit(self, name: str) -> UnitEntry:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_json(self) -> str:
        d = asdict(self)
        d["arch"] = self.arch.to_dict()
        d["version"] = self.arch.pick(VERSION, VERSION_GENERIC)
        if self.quant:
            old = (VERSION_QUANT_V3, VERSION_QUANT_V4)
            d["version"] = self.version if self.version in old else VERSION_QUANT  # written as read
        else:
            del d["quant"]  # unquantized stores keep their version-1/2 manifest
        return json.dumps(d, indent=1)


def unit_file(unit: str) -> str:
    if unit.startswith("layer."):
        return f"units/layer_{int(unit.split('.')[1]):04d}.bin"
    return f"units/{unit}.bin"


def read_manifest(root: Path) -> Manifest:
    path = Path(root) / MANIFEST
    if not Path(root).exists():
        raise InputError(f"{root}: not found (expected a store made by `horizon convert`)")
    if not Path(root).is_dir():
        raise InputError(f"{root}: not a horizon store (a file, not a directory made by `horizon convert`)")
    if not path.is_file():
        raise InputError(f"{root}: not a horizon store (no {MANIFEST}; make one with `horizon convert`)")
    try:
        d = json.loads(path.read_text())
        if d.get("format") != FORMAT:
            raise ValueError(f"format is {d.get('format')!r}, not {FORMAT!r}")
        if d.get("version") not in READABLE:
            raise ValueError(
                f"format version {d.get('version')} is not supported (this horizon reads {', '.join(map(str, READABLE))})"
            )
        if d["dtype"] not in DTYPES:
            raise ValueError(f"unknown dtype {d['dtype']!r}")
        if d.get("quant", "") not in QUANTS:
            raise ValueError(f"unknown quantization {d['quant']!r}")
        if bool(d.get("quant")) != (d["version"] in QUANT_VERSIONS):
            raise ValueError(
                f"format version {d['version']} and quantization {d.get('quant', '')!r} disagree"
            )
        units = [UnitEntry(**{**u, "tensors": [TensorEntry(**t) for t in u["tensors"]]}) for u in d["units"]]
        return Manifest(
            dtype=d["dtype"],
            arch=ArchSpec.from_dict(d["arch"]),
            units=units,
            params=d["params"],
            version=d["version"],
            source=d.get("source", ""),
            created_by=d.get("created_by", ""),
            extra=d.get("extra", {}),
            quant=d.get("quant", ""),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path}: corrupt manifest ({e})") from None
