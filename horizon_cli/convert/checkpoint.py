"""Reading an HF checkpoint directory tensor by tensor: safetensors (sharded or single) or .bin.

Safetensors files are parsed here (8-byte header length, JSON header, raw data) and each tensor
is read with one positioned read, so memory holds one tensor at a time and a truncated or
corrupted file is reported by name. `.bin` files load with `weights_only=True` (no code is ever
unpickled) and `mmap=True`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int  # absolute byte offset in the file (safetensors only)
    nbytes: int


def weight_files(src: Path) -> list[Path]:
    """The checkpoint's weight files, in a stable order; InputError when there are none."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        p = src / index
        if p.is_file():
            try:
                wm = json.loads(p.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise InputError(f"{p}: not a valid index ({e})") from None
            files = sorted(set(wm.values()))
            for f in files:
                if not (src / f).is_file():
                    raise InputError(f"{src / f}: listed in {index} but missing")
            return [src / f for f in files]
    st = sorted(src.glob("*.safetensors"))
    if st:
        return st
    bins = sorted(src.glob("pytorch_model*.bin"))
    if bins:
        return bins
    raise InputError(f"{src}: no weights found (expected *.safetensors or pytorch_model*.bin)")


def safetensors_header(path: Path) -> list[TensorInfo]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise InputError(f"{path}: truncated safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise InputError(f"{path}: corrupted safetensors header (length {n} for a {size}-byte file)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InputError(f"{path}: corrupted safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupted safetensors header (not a mapping)")
    base, out = 8 + n, []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = ST_DTYPES[meta["dtype"]]
            shape = tuple(int(d) for d in meta["shape"])
            a, b = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{path}: corrupted safetensors header entry for {name}") from None
        numel = int(np.prod(shape)) if shape else 1
        if b - a != numel * torch.empty((), dtype=dtype).element_size() or a < 0:
            raise InputError(f"{path}: tensor {name} has {b - a} bytes for shape {shape} ({meta['dtype']})")
        if base + b > size:
            raise InputError(f"{path}: truncated (tensor {name} ends past the end of the file)")
        out.append(TensorInfo(name, path, shape, dtype, base + a, b - a))
    return out


def read_safetensor(info: TensorInfo) -> torch.Tensor:
    buf = bytearray(info.nbytes)
    with open(info.file, "rb", buffering=0) as f:
        n = os.preadv(f.fileno(), [buf], info.start) if info.nbytes else 0
        while n < info.nbytes:
            got = os.preadv(f.fileno(), [memoryview(buf)[n:]], info.start + n)
            if not got:
                raise InputError(f"{info.file}: truncated while reading {info.name}")
            n += got
    if not info.nbytes:
        return torch.empty(info.shape, dtype=info.dtype)
    return torch.frombuffer(buf, dtype=info.dtype).view(info.shape)


def load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # pickle errors, zip errors, refused globals
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{path}: cannot load as a weights-only PyTorch checkpoint ({first})") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise InputError(f"{path}: not a state dict of tensors")
    return sd


class Checkpoint:
    """Lists every tensor (name, shape, dtype) up front, then yields them one at a time."""

    def __init__(self, src: Path):
        self.src = Path(src)
        if not self.src.is_dir():
            raise InputError(f"{self.src}: not found (expected an HF checkpoint directory)")
        self.files = weight_files(self.src)
        self.infos: dict[str, TensorInfo] = {}
        for f in self.files:
            for info in self._list(f):
                if info.name in self.infos:
                    raise InputError(f"{f}: tensor {info.name} appears twice in the checkpoint")
                self.infos[info.name] = info

    def _list(self, f: Path) -> list[TensorInfo]:
        if f.suffix == ".safetensors":
            return safetensors_header(f)
        sd = load_bin(f)
        return [TensorInfo(k, f, tuple(v.shape), v.dtype, -1, v.numel() * v.element_size()) for k, v in sd.items()]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.infos.values())

    def tensors(self, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for the wanted names, file by file, one tensor in memory at a time."""
        for f in self.files:
            if f.suffix == ".safetensors":
                for info in sorted(
                    (i for i in self.infos.values() if i.file == f and i.name in names), key=lambda i: i.start
                ):
                    yield info.name, read_safetensor(info)
            else:
                sd = load_bin(f)
                for k in [k for k in sd if k in names]:
                    yield k, sd.pop(k)
                del sd
