"""Writing a store: unit files filled tensor by tensor, then the manifest, then one rename.

Peak memory is one tensor: each arrives, is cast to the store dtype and written with pwrite at
its offset; nothing else is held.
"""

from __future__ import annotations

import os
import shutil
import zlib
from pathlib import Path

import torch

from .. import __version__
from ..arch import ArchSpec
from ..errors import InputError
from .layout import file_bytes, layouts
from .manifest import MANIFEST, Manifest, TensorEntry, UnitEntry, unit_file
from .manifest import DTYPES as STORE_DTYPES


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's raw bytes without a copy (numpy has no bf16, so view as bytes first)."""
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class StoreWriter:
    """Writes the store into `dir` (usually a temp dir from fsutil.atomic_dir)."""

    def __init__(self, root: Path, arch: ArchSpec, dtype: str, source: str = ""):
        self.root = Path(root)
        self.arch, self.dtype, self.source = arch, dtype, source
        self.torch_dtype = STORE_DTYPES[dtype]
        self.itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        self.layouts = {lay.name: lay for lay in layouts(arch)}
        self.entries: dict[str, dict[str, TensorEntry]] = {u: {} for u in self.layouts}
        self.fds: dict[str, int] = {}
        (self.root / "units").mkdir(parents=True, exist_ok=True)
        for name, lay in self.layouts.items():
            fd = os.open(self.root / unit_file(name), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, self.unit_nbytes(lay.numel))  # sparse zeros: padding costs nothing
            self.fds[name] = fd

    def unit_nbytes(self, numel: int) -> int:
        return file_bytes(numel, self.itemsize)

    def write(self, unit: str, name: str, t: torch.Tensor) -> int:
        """Cast `t` to the store dtype and write it at its slot. Returns bytes written."""
        slot = self.layouts[unit].slot(name)
        if tuple(t.shape) != slot.shape:
            raise InputError(f"{slot.hf}: shape {tuple(t.shape)} does not match the config's {slot.shape}")
        data = tensor_bytes(t.to(self.torch_dtype))
        off = slot.offset * self.itemsize
        n = os.pwrite(self.fds[unit], data, off)
        while n < len(data):  # pwrite may write less than asked on some file systems
            n += os.pwrite(self.fds[unit], data[n:], off + n)
        self.entries[unit][name] = TensorEntry(
            name, slot.hf, self.dtype, list(slot.shape), off, len(data), zlib.crc32(data)
        )
        return len(data)

    def write_unit(self, unit: str, flat: torch.Tensor) -> None:
        """Write a whole flat unit buffer (already in the store dtype and layout) at once."""
        lay = self.layouts[unit]
        assert flat.dtype == self.torch_dtype and flat.numel() == lay.numel
        for s in lay.slots:
            self.write(unit, s.name, flat[s.offset : s.offset + s.numel].view(s.shape))

    def copy_file(self, src: Path, rel: str) -> None:
        dst = self.root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)

    def finish(self, extra: dict | None = None) -> Manifest:
        """Check every tensor was written, write the manifest, close files."""
        units = []
        for name, lay in self.layouts.items():
            missing = [s.hf for s in lay.slots if s.name not in self.entries[name]]
            if missing:
                raise InputError(f"tensor {missing[0]} is missing from the checkpoint")
            tensors = [self.entries[name][s.name] for s in lay.slots]
            units.append(UnitEntry(name, unit_file(name), lay.numel, self.unit_nbytes(lay.numel), tensors))
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        params = sum(lay.params for lay in self.layouts.values())
        m = Manifest(
            dtype=self.dtype,
            arch=self.arch,
            units=units,
            params=params,
            source=self.source,
            created_by=f"horizon {__version__}",
            extra=extra or {},
        )
        (self.root / MANIFEST).write_text(m.to_json())
        return m

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

