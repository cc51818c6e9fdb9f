"""Opening a store: the manifest, and each unit's raw buffer by mmap or by an explicit read.

`Store.open` reads only the manifest (milliseconds). `unit_view` maps a unit file copy-on-write:
pages load on demand and writes never reach the file (invariant 7). `read_unit` copies a unit
into a caller's buffer (anonymous or pinned memory) and checks every tensor's checksum on the way.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import torch

from ..arch import unit_names
from ..errors import InputError
from ..fsutil import read_exact
from ..quant import nf4
from .layout import UnitLayout, unit_layout
from .manifest import MANIFEST, Manifest, UnitEntry, read_manifest
from .packed import PackedLayout, packed_layout, packs
from .writer import tensor_bytes


class Store:
    def __init__(self, root: Path, manifest: Manifest):
        self.root = Path(root)
        self.manifest = manifest
        self.arch = manifest.arch
        self.dtype = manifest.torch_dtype
        names = [u.name for u in manifest.units]
        if names != unit_names(self.arch):
            raise InputError(f"{self.root / MANIFEST}: units {names[:3]}... do not match the architecture's")
        self.layouts = {u.name: unit_layout(self.arch, u.name) for u in manifest.units}
        self.quant = manifest.quant
        item = self.dtype.itemsize
        # quantized stores: the byte layout of each packed unit (decoder layers), as the store's
        # version has it (its NF4 scheme; version 3: routers and expert biases NF4 too)
        self.packed: dict[str, PackedLayout] = {
            n: packed_layout(self.arch, lay, item, self.quant, manifest.version)
            for n, lay in self.layouts.items()
            if packs(n, self.quant)
        }

    @staticmethod
    def open(root: str | Path) -> Store:
        root = Path(root)
        m = read_manifest(root)
        store = Store(root, m)
        store.check_files()
        return store

    def check_files(self) -> None:
        """Cheap structural checks (no data is read): every unit file exists and is large enough,
        and the manifest's tensor table agrees with the layout the architecture implies."""
        itemsize = self.dtype.itemsize
        for u in self.manifest.units:
            path = self.root / u.file
            if not path.is_file():
                raise InputError(f"{path}: missing unit file of store {self.root}")
            if path.stat().st_size < u.nbytes:
                raise InputError(f"{path}: truncated ({path.stat().st_size} of {u.nbytes} bytes)")
            lay, dt = self.layouts[u.name], self.manifest.dtype
            want = [
                (s.name, s.hf, list(s.shape), s.offset * itemsize, s.numel * itemsize, dt) for s in lay.slots
            ]
            if u.name in self.packed:
                want = [
                    (s.name, s.hf, list(s.shape), s.offset, s.nbytes, s.quant or dt)
                    for s in self.packed[u.name].slots
                ]
            got = [(t.name, t.hf, list(t.shape), t.offset, t.nbytes, t.dtype) for t in u.tensors]
            if lay.numel != u.numel or got != want or u.nbytes < self.unit_bytes(u.name):
                raise InputError(
                    f"{self.root / MANIFEST}: unit {u.name} does not match its architecture's layout"
                )

    @property
    def units(self) -> list[UnitEntry]:
        return self.manifest.units

    def layout(self, unit: str) -> UnitLayout:
        return self.layouts[unit]

    def unit_bytes(self, unit: str) -> int:
        """Bytes of the unit's data: the packed layout's, or numel elements of the store dtype."""
        if unit in self.packed:
            return self.packed[unit].nbytes
        return self.layouts[unit].numel * self.dtype.itemsize

    def unit_view(self, unit: str) -> torch.Tensor:
        """The unit's flat buffer, mapped copy-on-write: (numel,) in the store dtype, or the raw
        bytes (uint8) of a packed unit."""
        u = self.manifest.unit(unit)
        arr = np.memmap(self.root / u.file, dtype=np.uint8, mode="c", shape=(self.unit_bytes(unit),))
        t = torch.from_numpy(arr)
        return t if unit in self.packed else t.view(self.dtype)

    def tensor(self, unit: str, name: str) -> torch.Tensor:
        """A tensor in the store dtype (a quantized one dequantized)."""
        if unit in self.packed:
            p = self.packed[unit].slot(name)
            raw = self.unit_view(unit)[p.offset : p.offset + p.nbytes]
            if not p.quant:
                return raw.view(self.dtype).view(p.shape)
            out = torch.empty(p.numel, dtype=self.dtype)
            scheme = self.packed[unit].scheme
            return nf4.dequantize_packed(raw, p.numel, self.dtype, out, scheme).view(p.shape)
        s = self.layouts[unit].slot(name)
        return self.unit_view(unit)[s.offset : s.offset + s.numel].view(s.shape)

    def read_unit(self, unit: str, out: torch.Tensor, verify: bool = True) -> None:
        """Read the unit file into `out` ((numel,) in the store dtype; a packed unit: its bytes,
        uint8) and check its checksums."""
        u = self.manifest.unit(unit)
        packed = unit in self.packed
        want = (torch.uint8, self.unit_bytes(unit)) if packed else (self.dtype, u.numel)
        if (out.dtype, out.numel()) != want or not out.is_contiguous():
            raise ValueError(f"read_unit({unit}): out must be contiguous ({want[1]},) {want[0]}")
        buf = tensor_bytes(out)
        read_exact(self.root / u.file, buf)
        if verify:
            self.verify_unit(unit, buf)

    def verify_unit(self, unit: str, buf: memoryview | None = None) -> None:
        u = self.manifest.unit(unit)
        if buf is None:
            buf = tensor_bytes(self.unit_view(unit))
        for t in u.tensors:
            if zlib.crc32(buf[t.offset : t.offset + t.nbytes]) != t.crc32:
                raise InputError(
                    f"{self.root / u.file}: checksum mismatch in tensor {t.hf} (store is corrupt)"
                )

    def verify(self, progress=None) -> None:
        """Check every tensor's checksum; raises InputError at the first mismatch."""
        for u in self.units:
            self.verify_unit(u.name)
            if progress:
                progress(u.nbytes)

    def nbytes(self) -> int:
        return sum(os.path.getsize(self.root / u.file) for u in self.units)
