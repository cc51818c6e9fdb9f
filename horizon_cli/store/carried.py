"""Tensors a store carries but never trains: a multimodal checkpoint's vision or audio tower and
projector, modules the text forward never calls (arch.generic's `carried`).

Convert writes them, byte for byte in their own dtype and under their checkpoint names, into one
safetensors file beside the store's config (`hf/carried.safetensors`, with its CRC32 in
`hf/carried.crc32`); checkpoints copy `hf/` like the config, and export writes the file back as
one more shard of the checkpoint it writes, so `from_pretrained` of the multimodal class finds every
tensor it had, the untrained ones bitwise.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from ..errors import InputError

FILE = "carried.safetensors"
SUM = "carried.crc32"
CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def write_carried(
    hf_dir: Path, infos: list[tuple[str, tuple[int, ...], torch.dtype, int]], tensors: Iterator
) -> int:
    """infos: (name, shape, dtype, nbytes) in file order; tensors: (name, pieces) in any order, each
    piece a 1-D run of the tensor (convert.hf_files). Returns the bytes written."""
    header: dict[str, dict] = {}
    off = 0
    for name, shape, dtype, n in infos:
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    crc = zlib.crc32(head)
    hf_dir.mkdir(parents=True, exist_ok=True)
    with open(hf_dir / FILE, "wb") as f:
        f.write(head)
        for name, pieces in tensors:
            f.seek(len(head) + header[name]["data_offsets"][0])
            for p in pieces:
                f.write(p.contiguous().view(torch.uint8).numpy().data)
    with open(hf_dir / FILE, "rb") as f:  # the file's checksum as written (tensors in any order)
        f.seek(len(head))
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    (hf_dir / SUM).write_text(f"{crc:08x}\n")
    return off


def carried_names(hf_dir: Path) -> list[str]:
    """The tensors of a store's carried file (none when it has none)."""
    path = hf_dir / FILE
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return [k for k in header if k != "__metadata__"]


def verify_carried(hf_dir: Path) -> None:
    """InputError when the carried file's bytes are not those convert wrote."""
    path = hf_dir / FILE
    if not path.is_file():
        return
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    want = (hf_dir / SUM).read_text().strip() if (hf_dir / SUM).is_file() else None
    if want != f"{crc:08x}":
        raise InputError(f"{path}: checksum mismatch (the carried tensors are damaged)")
