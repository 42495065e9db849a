"""Checksums of a model directory (standard library and numpy only; never the native library).

- CRC-32C (Castagnoli) of every neuron block and of each block file's tables: the format is in
  docs/formats.md; the engine verifies blocks on every read with SSE4.2
  (native/src/checksum.c). ``crc32c`` here is the byte-at-a-time reference the tests compare
  the C code to; ``crc32c_rows`` computes one CRC per row of a uint8 matrix with numpy, fast
  enough for the converter (it runs across all rows at once).
- CRC-32 (zlib) of whole files the manifest names (base.gguf, predictor files): checked once
  when a model directory is opened (``file_crc32``), with the standard library's zlib.
"""

from __future__ import annotations

import os
import zlib

import numpy as np

POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ POLY, t >> 1).astype(np.uint32)
    return t


TABLE = _table()                       # uint32 [256]: one byte
_TABLE_LIST = [int(x) for x in TABLE]


def _slice4() -> np.ndarray:
    """uint32 [4, 256]: T[j][b] = CRC state after byte b followed by j zero bytes (slicing-by-4)."""
    t = np.empty((4, 256), dtype=np.uint32)
    t[0] = TABLE
    for j in range(1, 4):
        t[j] = (t[j - 1] >> 8) ^ TABLE[t[j - 1] & 0xFF]
    return t


_T4 = _slice4()


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC-32C of ``data`` continuing from ``crc`` (0 to start); crc32c(b"123456789") == 0xE3069283.
    Byte at a time: the reference, for small inputs."""
    c = crc ^ 0xFFFFFFFF
    t = _TABLE_LIST
    for b in bytes(data):
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def crc32c_rows(rows: np.ndarray) -> np.ndarray:
    """uint32 [n]: CRC-32C of each row of uint8 ``rows`` [n, m] (slicing-by-4 across rows)."""
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    n, m = rows.shape
    c = np.full(n, 0xFFFFFFFF, dtype=np.uint32)
    m4 = m - m % 4
    if m4:
        words = rows[:, :m4].view("<u4")                  # [n, m4 / 4]
        t0, t1, t2, t3 = _T4
        for j in range(words.shape[1]):
            c ^= words[:, j]
            c = t3[c & 0xFF] ^ t2[(c >> 8) & 0xFF] ^ t1[(c >> 16) & 0xFF] ^ t0[c >> 24]
    for j in range(m4, m):
        c = TABLE[(c ^ rows[:, j]) & 0xFF] ^ (c >> 8)
    return c ^ np.uint32(0xFFFFFFFF)


def file_crc32(path: str | os.PathLike, *, fd: int | None = None, chunk: int = 8 << 20) -> int:
    """zlib CRC-32 of a whole file (of the open descriptor ``fd`` if given, read from offset 0).

    What the read brings into the page cache it drops again, chunk by chunk: checking base.gguf
    when a model opens must not leave the whole file cached (charged to the process's memory
    cgroup, where a memory limit binds), only what llama.cpp then maps and touches. Pages that
    were cached before (another process, an earlier open) stay (pagecache.py)."""
    from leanstream_ggml.model import pagecache

    own = fd is None
    if own:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        before = pagecache.resident_pages(fd, os.fstat(fd).st_size)
        c, off = 0, 0
        while True:
            b = os.pread(fd, chunk, off)
            if not b:
                pagecache.drop_not_resident(fd, before, 0, off)   # any readahead left over
                return c
            c = zlib.crc32(b, c)
            # this chunk and the readahead before it (the kernel reads ahead of the position)
            pagecache.drop_not_resident(fd, before, max(off - chunk, 0), off + len(b))
            off += len(b)
    finally:
        if own:
            os.close(fd)
