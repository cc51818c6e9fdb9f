"""Writing a store: unit files filled tensor by tensor, then the manifest, then one rename.

Peak memory is two pieces of one tensor: a tensor arrives whole or as consecutive pieces, each is
cast to the store dtype in at most PIECE elements at a time (into two alternating scratch
buffers), its checksum accumulated, and written with pwrite at its offset by a writer thread while
the next piece is read; nothing else is held.
"""

from __future__ import annotations

import os
import shutil
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .. import __version__
from ..arch import ArchSpec
from ..errors import InputError
from ..quant import nf4
from .layout import file_bytes, layouts
from .manifest import DTYPES as STORE_DTYPES
from .manifest import MANIFEST, Manifest, TensorEntry, UnitEntry, unit_file
from .packed import PackedLayout, PackedSlot, packed_layout, packs

PIECE = 8 << 20  # elements cast and written at once: 16 MiB in bf16, 32 MiB in fp32


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    n = 0
    while n < len(data):  # pwrite may write less than asked on some file systems
        n += os.pwrite(fd, data[n:], offset + n)


INT_EXACT = 256  # integers up to this magnitude are exact in bfloat16, float16 and float32


def _finite(x: torch.Tensor) -> bool:
    """No inf or NaN in x (aminmax propagates both and is several times faster than isfinite)."""
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's raw bytes without a copy (numpy has no bf16, so view as bytes first)."""
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


class StoreWriter:
    """Writes the store into `dir` (usually a temp dir from fsutil.atomic_dir)."""

    def __init__(self, root: Path, arch: ArchSpec, dtype: str, source: str = "", quant: str = ""):
        """quant: "" or "nf4" (decoder layers packed, their linear weights quantized: store.packed)."""
        self.root = Path(root)
        self.arch, self.dtype, self.source, self.quant = arch, dtype, source, quant
        self.torch_dtype = STORE_DTYPES[dtype]
        self.itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        self.layouts = {lay.name: lay for lay in layouts(arch)}
        self.packed: dict[str, PackedLayout] = {
            n: packed_layout(arch, lay, self.itemsize, quant)
            for n, lay in self.layouts.items()
            if packs(n, quant)
        }
        self.entries: dict[str, dict[str, TensorEntry]] = {u: {} for u in self.layouts}
        self.fds: dict[str, int] = {}
        self._scratch: list[torch.Tensor | None] = [None, None]  # (<= PIECE,) cast buffers, alternating
        self._turn = 0
        self._pool: ThreadPoolExecutor | None = None  # one writer thread, created on first use
        self._pending: Future | None = None  # the one pwrite in flight
        (self.root / "units").mkdir(parents=True, exist_ok=True)
        for name in self.layouts:
            fd = os.open(self.root / unit_file(name), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, self.file_nbytes(name))  # sparse zeros: padding costs nothing
            self.fds[name] = fd

    def unit_nbytes(self, numel: int) -> int:
        return file_bytes(numel, self.itemsize)

    def file_nbytes(self, unit: str) -> int:
        if unit in self.packed:
            return file_bytes(self.packed[unit].nbytes, 1)
        return self.unit_nbytes(self.layouts[unit].numel)

    def write(self, unit: str, name: str, t: torch.Tensor) -> int:
        """Cast `t` to the store dtype and write it at its slot. Returns bytes written."""
        slot = self.layouts[unit].slot(name)
        if tuple(t.shape) != slot.shape:
            raise InputError(f"{slot.hf}: shape {tuple(t.shape)} does not match the config's {slot.shape}")
        return self.write_stream(unit, name, [t.reshape(-1)])

    def write_stream(
        self,
        unit: str,
        name: str,
        pieces: Iterable[torch.Tensor],
        on_piece: Callable[[int], None] = lambda n: None,
        wait: bool = True,
    ) -> int:
        """Write a tensor given as consecutive 1-D pieces of its row-major flattening (any float
        dtype). `on_piece(nbytes)` reports each source piece's bytes. Returns bytes written.

        Each piece is cast (into one of two alternating scratch buffers), checksummed, and handed
        to a writer thread, so reading the next piece overlaps writing this one; at most one write
        is in flight, hence a piece's memory must stay untouched until the piece after next is
        asked for (Checkpoint.tensors alternates two read buffers for this). `wait=False` returns
        with the last write possibly in flight (`finish` waits); the default returns when the
        data is in the file, so callers may reuse `pieces` at once."""
        slot = self.layouts[unit].slot(name)
        base = slot.offset * self.itemsize
        if unit in self.packed:
            p = self.packed[unit].slot(name)
            if p.quant:
                return self._write_nf4(unit, p, pieces, on_piece, wait)
            base = p.offset
        fd, pos, crc = self.fds[unit], 0, 0
        for piece in pieces:
            flat = piece.reshape(-1)
            if pos + flat.numel() > slot.numel:
                raise InputError(f"{slot.hf}: more than the {slot.numel} elements of shape {slot.shape}")
            for i in range(0, flat.numel(), PIECE):
                data = tensor_bytes(self._cast(slot.hf, flat[i : i + PIECE]))
                crc = zlib.crc32(data, crc)
                self._submit(fd, data, base + (pos + i) * self.itemsize)
            pos += flat.numel()
            on_piece(flat.numel() * flat.element_size())
        if wait:
            self._drain()
        if pos != slot.numel:
            raise InputError(f"{slot.hf}: {pos} elements where shape {slot.shape} needs {slot.numel}")
        nbytes = slot.numel * self.itemsize
        self.entries[unit][name] = TensorEntry(name, slot.hf, self.dtype, list(slot.shape), base, nbytes, crc)
        return nbytes

    def _write_nf4(self, unit: str, p: PackedSlot, pieces, on_piece, wait: bool) -> int:
        """Quantize a tensor as its pieces arrive (whole blocks at a time; a piece's tail waits for
        the next piece), then write the double-quantized scales (quant/nf4.py, bitsandbytes'
        layout). The region's checksum runs over its parts and the zero padding between them, in
        file order."""
        fd, pos, crc = self.fds[unit], 0, 0
        absmax: list[torch.Tensor] = []
        tail = torch.empty(0, dtype=self.torch_dtype)
        for piece in pieces:
            flat = piece.reshape(-1)
            if pos + tail.numel() + flat.numel() > p.numel:
                raise InputError(f"{p.hf}: more than the {p.numel} elements of shape {p.shape}")
            x = torch.cat([tail, flat.to(self.torch_dtype)])  # the store dtype, as bitsandbytes gets it
            whole = x.numel() // nf4.BLOCK * nf4.BLOCK
            for i in range(0, whole, PIECE):
                codes, amax = nf4.quantize_blocks(x[i : min(whole, i + PIECE)])
                if not _finite(amax):
                    raise InputError(f"{p.hf}: inf or NaN values in {self.dtype}, which NF4 cannot quantize")
                data = tensor_bytes(codes)
                crc = zlib.crc32(data, crc)
                self._drain()
                _pwrite_all(fd, data, p.offset + (pos + i) // 2)
                absmax.append(amax)
            pos += whole
            tail = x[whole:].clone()
            on_piece(flat.numel() * flat.element_size())
        if pos + tail.numel() != p.numel:
            raise InputError(f"{p.hf}: {pos + tail.numel()} elements where shape {p.shape} needs {p.numel}")
        scales = nf4.double_quantize(torch.cat(absmax))
        parts = nf4.parts(p.numel, self.itemsize)
        end = parts["codes"][1]
        for name, (off, n) in parts.items():
            if name == "codes":
                continue
            crc = zlib.crc32(bytes(off - end), crc)  # the padding before this part
            data = tensor_bytes(scales[name])
            assert len(data) == n, (name, len(data), n)
            crc = zlib.crc32(data, crc)
            _pwrite_all(fd, data, p.offset + off)
            end = off + n
        crc = zlib.crc32(bytes(p.nbytes - end), crc)
        self.entries[unit][p.name] = TensorEntry(p.name, p.hf, "nf4", list(p.shape), p.offset, p.nbytes, crc)
        return p.nbytes

    def _submit(self, fd: int, data: memoryview, offset: int) -> None:
        self._drain()  # one write in flight: the buffers being filled now are never the ones written
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="store-write")
        self._pending = self._pool.submit(_pwrite_all, fd, data, offset)

    def _drain(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()  # re-raises the writer thread's OSError here

    def _cast(self, hf: str, x: torch.Tensor) -> torch.Tensor:
        """x ((n,), n <= PIECE) in the store dtype: itself when it already is, else in a scratch."""
        if x.dtype == self.torch_dtype:
            return x.contiguous()
        if not x.dtype.is_floating_point and x.numel() and int(x.abs().max()) > INT_EXACT:
            raise InputError(
                f"{hf}: integer values beyond {INT_EXACT}, which the store's float units do not hold "
                "exactly in every compute dtype"
            )
        k = self._turn = (self._turn + 1) % 2
        scratch = self._scratch[k]
        if scratch is None or scratch.numel() < x.numel():
            scratch = self._scratch[k] = torch.empty(
                min(PIECE, max(x.numel(), 1 << 20)), dtype=self.torch_dtype
            )
        out = scratch[: x.numel()]
        out.copy_(x)
        if self.torch_dtype == torch.float16 and x.numel() and not _finite(out) and _finite(x):
            raise InputError(
                f"{hf}: values outside the float16 range; convert with --dtype bfloat16 or float32"
            )
        return out

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
        self._drain()
        units = []
        for name, lay in self.layouts.items():
            missing = [s.hf for s in lay.slots if s.name not in self.entries[name]]
            if missing:
                raise InputError(f"tensor {missing[0]} is missing from the checkpoint")
            tensors = [self.entries[name][s.name] for s in lay.slots]
            units.append(UnitEntry(name, unit_file(name), lay.numel, self.file_nbytes(name), tensors))
        self.close()
        params = sum(lay.params for lay in self.layouts.values())
        m = Manifest(
            dtype=self.dtype,
            arch=self.arch,
            units=units,
            params=params,
            source=self.source,
            created_by=f"horizon {__version__}",
            extra=extra or {},
            quant=self.quant,
        )
        (self.root / MANIFEST).write_text(m.to_json())
        return m

    def close(self) -> None:
        """Wait for the write in flight (its error, if any, is dropped: close runs on the way out
        of a failure), stop the writer thread, close the unit files. Idempotent."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.exception()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
