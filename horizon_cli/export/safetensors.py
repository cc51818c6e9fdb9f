"""Writing safetensors shards tensor by tensor: the header first (offsets are known from shapes),
then each tensor's bytes appended, so no shard is ever held in memory."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from ..store.writer import tensor_bytes

ST_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
}


def write_shard(
    path: Path,
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    fetch: Callable[[str], torch.Tensor],
    on_bytes: Callable[[int], None] = lambda n: None,
) -> None:
    """entries: (name, shape, dtype) in file order; fetch(name) returns the tensor to write."""
    header, off = {}, 0
    for name, shape, dtype in entries:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in entries:
            t = fetch(name)
            assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, name
            data = tensor_bytes(t)
            f.write(data)
            on_bytes(len(data))
