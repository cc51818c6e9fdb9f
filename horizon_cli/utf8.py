"""Input text files (configs, data) must be UTF-8: find the first bad byte and name where it is.

Used before parsing, because YAML and `datasets` report a bad byte as a deep decoding error that
names neither the file nor the line. One rule for every input file (a config, a data file, a
prompts file, a dataset_info.json): a UTF-8 byte-order mark at its start (Windows editors write
one) is dropped, never read as text.
"""

from __future__ import annotations

from pathlib import Path

from .errors import InputError

CHUNK = 4 << 20  # bytes decoded at a time when scanning a file

_BOMS = {b"\xff\xfe": "UTF-16", b"\xfe\xff": "UTF-16"}
BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark


def decode(data: bytes, name: str) -> str:
    """`data` as text without a leading BOM, or an InputError naming `name`, the line and the byte
    offset of the first bad byte."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise _error(name, data, e.start, line=data.count(b"\n", 0, e.start) + 1) from None


def read_text(path: str | Path, name: str | None = None) -> str:
    """A UTF-8 text file's content, its BOM dropped (OSError as open raises it)."""
    return decode(Path(path).read_bytes(), name or str(path))


def has_bom(path: str | Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(BOM)) == BOM


def check_file(path: str | Path, name: str | None = None) -> None:
    """Scan a file in chunks; InputError at its first byte that is not UTF-8."""
    name = name or str(path)
    carry, base, lines = b"", 0, 0  # carry: a multi-byte character cut at a chunk's end
    with open(path, "rb") as f:
        head = f.read(2)
        f.seek(0)
        while True:
            chunk = f.read(CHUNK)
            data = carry + chunk
            if not data:
                return
            try:
                data.decode("utf-8")
                good = len(data)
            except UnicodeDecodeError as e:
                if not (chunk and e.reason == "unexpected end of data"):
                    line = lines + data.count(b"\n", 0, e.start) + 1
                    raise _error(name, data, e.start, line, base, head) from None
                good = e.start
            lines += data.count(b"\n", 0, good)
            base += good
            carry = data[good:]
            if not chunk:
                return


def _error(
    name: str, data: bytes, at: int, line: int, base: int = 0, head: bytes | None = None
) -> InputError:
    head = data[:2] if head is None else head
    hint = f"it looks like {_BOMS[head]}; " if head in _BOMS else ""
    return InputError(
        f"{name}: not UTF-8 text: byte 0x{data[at]:02x} at line {line} (byte offset {base + at}); "
        f"{hint}save it as UTF-8"
    )
