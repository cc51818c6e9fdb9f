"""CRC32 of a file from its pieces' CRC32s: each rank checksums the slices it writes, rank 0
combines them (zlib's crc32_combine, which Python's zlib does not expose), so no rank reads a
checkpoint back to checksum it.

crc(A + B) = Z_len(B)(crc(A)) ^ crc(B), where Z_n is the (linear, over GF(2)) effect of n zero
bytes on a CRC register: a 32 x 32 bit matrix, kept as 32 column words. The matrices for 2^k
bytes are made once by squaring; combining then costs one matrix-vector product per set bit of
len(B).
"""

from __future__ import annotations

POLY = 0xEDB88320  # CRC-32 (zlib), reflected


def _times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


def _zero_byte_ops(k_max: int = 64) -> list[list[int]]:
    """ops[k]: the operator of 2^k zero bytes."""
    bit = [POLY] + [1 << (n - 1) for n in range(1, 32)]  # one zero bit
    byte = _square(_square(_square(bit)))  # 8 zero bits
    ops = [byte]
    for _ in range(k_max - 1):
        ops.append(_square(ops[-1]))
    return ops


_OPS = _zero_byte_ops()


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32 of A + B from crc(A), crc(B) and len(B) in bytes."""
    k = 0
    while len_b:
        if len_b & 1:
            crc_a = _times(_OPS[k], crc_a)
        len_b >>= 1
        k += 1
    return crc_a ^ crc_b


def crc32_of_pieces(pieces: list[tuple[int, int, int]]) -> int:
    """CRC32 of consecutive pieces given as (offset, crc, length), in any order."""
    crc, end = 0, None
    for off, c, n in sorted(pieces):
        if end is not None and off != end:
            raise ValueError(f"pieces leave a gap or overlap at byte {end} (next starts at {off})")
        crc, end = crc32_combine(crc, c, n), off + n
    return crc
