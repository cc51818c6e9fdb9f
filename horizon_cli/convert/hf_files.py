"""Reading an HF checkpoint directory tensor by tensor: safetensors (sharded or single) or .bin.

Safetensors files are parsed here (8-byte header length, JSON header, raw data) and each tensor
is read in pieces of at most CHUNK_BYTES with positioned reads into two alternating buffers, so
memory holds two pieces at a time, whatever the tensor's size, and a truncated or corrupted file
is reported by name. `.bin` files load with `weights_only=True` (no code is ever unpickled) and
`mmap=True`; the pages of each tensor are dropped from the process once it is written, so the
mapped file does not accumulate in RSS.
"""

from __future__ import annotations

import ctypes
import fnmatch
import itertools
import json
import math
import os
import struct
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER = 100 << 20  # the safetensors reference implementation refuses larger headers too
CHUNK_BYTES = 32 << 20  # one read of a large tensor: two such buffers, plus casts, bound peak memory
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Files copied beside the weights so the store can be exported and tokenized without the source
# (and all a hub download fetches besides the weights and their index).
HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "processor_config.json",  # a multimodal checkpoint's processor (vision.encode): image processor, template
    "preprocessor_config.json",
)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int  # absolute byte offset in the file (safetensors only; -1 for .bin)
    nbytes: int


def weight_files(src: Path) -> list[Path]:
    """The checkpoint's weight files, in a stable order (pick_weights); InputError when there are
    none, or when an index names a file the directory lacks."""
    names = [p.name for p in src.iterdir() if p.is_file()] if src.is_dir() else []
    index, files = pick_weights(names, lambda name: index_files(src / name))
    if not files:
        raise InputError(f"{src}: no weights found (expected *.safetensors or pytorch_model*.bin)")
    for f in files:
        if not (src / f).is_file():
            raise InputError(f"{src / f}: listed in {index} but missing")
    return [src / f for f in files]


def pick_weights(names: Iterable[str], listed: Callable[[str], list[str]]) -> tuple[str | None, list[str]]:
    """(the index used or None, the weight files) among a checkpoint's top-level file names,
    safetensors before .bin: an index, else `model.safetensors`, else every `*.safetensors`; then
    the same for `pytorch_model*.bin`. `listed(index)` reads the files an index names. The same
    rule picks what to download from the hub (convert/hub.py)."""
    have = {n for n in names if "/" not in n and not n.startswith(".")}
    st_index, bin_index = INDEXES
    if st_index in have:
        return st_index, listed(st_index)
    if "model.safetensors" in have:
        return None, ["model.safetensors"]
    st = sorted(n for n in have if n.endswith(".safetensors"))
    if st:
        return None, st
    if bin_index in have:
        return bin_index, listed(bin_index)
    return None, sorted(n for n in have if fnmatch.fnmatchcase(n, "pytorch_model*.bin"))


def index_files(index: Path) -> list[str]:
    """The weight files an index's weight_map names (sorted); InputError for a broken index."""
    try:
        d = json.loads(index.read_text())
        wm = d.get("weight_map") if isinstance(d, dict) else None
        if not isinstance(wm, dict) or not wm or not all(isinstance(f, str) for f in wm.values()):
            raise ValueError("no weight_map of tensor names to file names")
        files = sorted(set(wm.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{index}: not a valid index ({e})") from None
    return files


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def safetensors_header(path: Path) -> list[TensorInfo]:
    """Every tensor a safetensors file lists, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise InputError(f"{path}: truncated safetensors header ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise InputError(
                f"{path}: truncated or corrupted safetensors header (length {n} for a {size}-byte file)"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InputError(f"{path}: corrupted safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupted safetensors header (not a mapping)")
    base = 8 + n
    return [
        _header_entry(path, name, meta, base, size) for name, meta in header.items() if name != "__metadata__"
    ]


def _header_entry(path: Path, name: str, meta, base: int, size: int) -> TensorInfo:
    try:
        code = meta["dtype"]
        shape = tuple(int(d) for d in meta["shape"])
        a, b = (int(x) for x in meta["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise InputError(f"{path}: corrupted safetensors header entry for tensor {name}") from None
    if code not in ST_DTYPES:
        raise InputError(f"{path}: tensor {name} has unsupported dtype {code!r}")
    dtype = ST_DTYPES[code]
    if a < 0 or min(shape, default=0) < 0 or b - a != math.prod(shape) * itemsize(dtype):
        raise InputError(
            f"{path}: corrupted safetensors header: tensor {name} has {b - a} bytes for shape {shape} ({code})"
        )
    if base + b > size:
        raise InputError(f"{path}: truncated: tensor {name} ends at byte {base + b} of a {size}-byte file")
    return TensorInfo(name, path, shape, dtype, base + a, b - a)


def _pread_exact(fd: int, buf: memoryview, offset: int, info: TensorInfo) -> None:
    n = 0
    while n < len(buf):
        got = os.preadv(fd, [buf[n:]], offset + n)
        if not got:  # the file shrank after its header was checked
            raise InputError(f"{info.file}: truncated while reading tensor {info.name}")
        n += got


def safetensor_pieces(fd: int, info: TensorInfo, buffers: Callable[[], bytearray]) -> Iterator[torch.Tensor]:
    """The tensor as consecutive 1-D pieces, each read into the next buffer `buffers()` hands out
    (buffers are reused: a piece is valid until that buffer comes round again). The kernel is
    asked to read ahead the next piece while this one is processed."""
    size = itemsize(info.dtype)
    pos = 0
    while pos < info.nbytes:
        buf = buffers()
        step = max(size, len(buf) // size * size)
        n = min(step, info.nbytes - pos)
        _pread_exact(fd, memoryview(buf)[:n], info.start + pos, info)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, info.start + pos + n, step, os.POSIX_FADV_WILLNEED)
        yield torch.frombuffer(buf, dtype=info.dtype, count=n // size)
        pos += n


def load_bin(path: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """(state dict, mapped): zip-format files are mapped (pages load on demand); the legacy
    pre-1.6 format cannot be mapped and loads whole."""
    mapped = zipfile.is_zipfile(path)
    if not mapped and _head(path, 2) == b"PK":
        raise InputError(f"{path}: truncated or corrupted (a zip archive without its central directory)")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as e:  # pickle errors, zip errors, refused globals
        raise InputError(f"{path}: cannot load as a weights-only PyTorch checkpoint ({_reason(e)})") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise InputError(f"{path}: not a state dict of tensors")
    return sd, mapped


def _head(path: Path, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _reason(e: Exception) -> str:
    """The informative line of a torch.load error (for a refused global, which one)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if lines and lines[0].startswith("Weights only load failed"):  # the refusal's detail follows
        why = [ln for ln in lines[1:] if "GLOBAL" in ln or "global" in ln or "WeightsUnpickler" in ln]
        return "refused: " + (why[0] if why else lines[0]).removeprefix("WeightsUnpickler error: ").rstrip(
            "."
        )
    return lines[0] if lines else type(e).__name__


def release_pages(t: torch.Tensor) -> None:
    """Drop a file-mapped tensor's pages from this process (they stay in the page cache and fault
    back in from the file if touched again). Only for storages mapped from a file: on anonymous
    memory MADV_DONTNEED would zero the data."""
    st = t.untyped_storage()
    a = (st.data_ptr() + PAGE - 1) // PAGE * PAGE
    b = (st.data_ptr() + st.nbytes()) // PAGE * PAGE
    if b > a and _LIBC is not None:
        _LIBC.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), MADV_DONTNEED)


MADV_DONTNEED = 4


def _libc() -> ctypes.CDLL | None:
    """The C library when it has madvise (Linux, macOS), else None: pages are then left mapped."""
    try:
        lib = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "madvise") else None


_LIBC = _libc()


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
        sd, _ = load_bin(f)
        return [
            TensorInfo(k, f, tuple(v.shape), v.dtype, -1, v.numel() * v.element_size()) for k, v in sd.items()
        ]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.infos.values())

    def tensors(self, names: set[str]) -> Iterator[tuple[str, Iterator[torch.Tensor]]]:
        """Yield (name, pieces) for the wanted names, file by file. `pieces` yields consecutive
        1-D runs of the row-major tensor. Pieces of safetensors files alternate between two read
        buffers, so a piece stays valid while the next one is read (a writer may still be writing
        it) and is overwritten when the one after that is read; consume them in order."""
        wanted = [i for i in self.infos.values() if i.name in names]
        st_sizes = [i.nbytes for i in wanted if i.file.suffix == ".safetensors"]
        size = min(CHUNK_BYTES, max(st_sizes, default=0))
        ring = [bytearray(size), bytearray(size)] if size else []
        turn = itertools.count()

        def buffers() -> bytearray:
            return ring[next(turn) % 2]

        for f in self.files:
            here = sorted((i for i in wanted if i.file == f), key=lambda i: i.start)
            if not here:
                continue
            if f.suffix == ".safetensors":
                with open(f, "rb", buffering=0) as fh:
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    for info in here:
                        yield info.name, safetensor_pieces(fh.fileno(), info, buffers)
            else:
                yield from self._bin_tensors(f, {i.name for i in here})

    def _bin_tensors(self, f: Path, names: set[str]) -> Iterator[tuple[str, Iterator[torch.Tensor]]]:
        """Pieces are views of the mapped file. A tensor's pages are dropped once the next
        tensor's second piece is asked for: by then its last write has completed (the writer
        keeps one write in flight), whereas dropping them earlier would let that write fault
        them back in for good. The last tensor's pages go with the mapping."""
        sd, mapped = load_bin(f)
        prev: list[torch.Tensor] = []
        for k in [k for k in sd if k in names]:
            t = sd.pop(k)

            def release(done: list[torch.Tensor] = prev) -> None:
                while done:
                    release_pages(done.pop())

            yield k, _tensor_pieces(t, release if mapped else lambda: None)
            prev.append(t)
            del t
        del sd, prev


def _tensor_pieces(t: torch.Tensor, after_first: Callable[[], None]) -> Iterator[torch.Tensor]:
    """t as 1-D views of at most CHUNK_BYTES; `after_first()` runs when the piece after the first
    (or the end) is asked for."""
    flat = t.reshape(-1)  # a view for the contiguous tensors checkpoints hold
    step = max(1, CHUNK_BYTES // t.element_size())
    for i in range(0, flat.numel(), step):
        yield flat[i : i + step]
        if i == 0:
            after_first()
    if flat.numel() == 0:
        after_first()
