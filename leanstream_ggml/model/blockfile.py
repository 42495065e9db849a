"""Block file format version 2 and expert file format version 1: the headers as the runtime
reads them (docs/formats.md).

One file per layer, ``ffn/blk.<il>.bin``, little-endian: a 4096-byte header, the perm and block
checksum tables, then the blocks at ``data_offset``. The engine reads these files itself
(native/src/blockfile.c); this module unpacks the header and checks the tables' CRC for
`leanstream verify`. The writer is the converter's (leanstream_convert/blockfile.py). The expert files
of a mixture-of-experts model (``experts/blk.<il>.bin``) likewise: ``read_expert_header``
(written by leanstream_convert/experts.py, read by native/src/blockfile.c).
"""

from __future__ import annotations

import os
import struct
from dataclasses import astuple, dataclass
from pathlib import Path

import numpy as np

from leanstream_ggml.model.checksum import crc32c
from leanstream_ggml.model.formats import BLOCK_MAGIC as MAGIC
from leanstream_ggml.model.formats import BLOCK_VERSION as VERSION
from leanstream_ggml.model.formats import (EXPERT_BIASES, EXPERT_HEADER_FIELDS, EXPERT_MAGIC, EXPERT_META_CRC_OFFSET,
                                           EXPERT_SCALES, EXPERT_VERSION, HEADER_BYTES, MIN_ALIGN, expert_extra_bytes)

PERM_OFFSET = HEADER_BYTES   # the perm table follows the header
_FMT = "<8sIIQQIIiiiIQQQQQQQQI"   # the header's fields (docs/formats.md), in order; 124 bytes
assert struct.calcsize(_FMT) == 124
META_CRC_OFFSET = 120


class BlockFileError(ValueError):
    pass


@dataclass
class BlockHeader:
    magic: bytes
    version: int
    il: int
    n_embd: int
    n_ff: int
    k: int                 # neurons per block
    n_blocks: int          # ceil(n_ff / k)
    gate_type: int         # enum ggml_type
    up_type: int
    down_type: int
    align: int
    gate_row_bytes: int
    up_row_bytes: int
    down_col_bytes: int
    block_stride: int      # roundup(k * (gate + up + down bytes), align)
    perm_offset: int       # 4096
    data_offset: int       # multiple of 4096 (and of align)
    file_size: int         # data_offset + n_blocks * block_stride
    crc_offset: int        # perm_offset + 4 * n_blocks * k: u32 block_crc[n_blocks]
    meta_crc: int = 0      # CRC-32C of [0, data_offset) with this field zero

    @property
    def block_payload(self) -> int:
        return self.k * (self.gate_row_bytes + self.up_row_bytes + self.down_col_bytes)

    def pack(self) -> bytes:
        return struct.pack(_FMT, *astuple(self)).ljust(HEADER_BYTES, b"\0")

    @classmethod
    def unpack(cls, buf: bytes, where: str = "block file") -> BlockHeader:
        if len(buf) < struct.calcsize(_FMT):
            raise BlockFileError(f"{where}: too short for a block file header")
        h = cls(*struct.unpack_from(_FMT, buf))
        if h.magic != MAGIC:
            raise BlockFileError(f"{where}: bad magic {h.magic!r} (not a LeanStream block file)")
        if h.version != VERSION:
            raise BlockFileError(f"{where}: block file version {h.version}, expected {VERSION} "
                                 f"(re-run `leanstream convert` with --force)")
        return h


def check_meta(meta: bytes, h: BlockHeader) -> bool:
    """meta = bytes [0, data_offset) of the file: does it match its meta_crc?"""
    b = bytearray(meta)
    b[META_CRC_OFFSET:META_CRC_OFFSET + 4] = b"\0\0\0\0"
    return crc32c(b) == h.meta_crc


_EXPERT_FMT = "<" + "".join(code for _, code in EXPERT_HEADER_FIELDS)


def read_expert_header(path: str | os.PathLike) -> dict:
    """The header fields of an expert file, with its tables (``expert_of_slot`` i32 [n_expert],
    ``slot_crc`` u32 [n_expert]), after the checks that need no ggml type table: magic, version,
    offsets, stride alignment, file size, meta_crc and expert_of_slot a permutation (the engine
    checks the sizes against the types as well). ValueError naming the file and what is wrong."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES:
            raise ValueError(f"{path}: truncated expert file ({len(head)} bytes, the header needs {HEADER_BYTES})")
        h = dict(zip((name for name, _ in EXPERT_HEADER_FIELDS), struct.unpack_from(_EXPERT_FMT, head)))
        if h["magic"] != EXPERT_MAGIC:
            raise ValueError(f"{path}: not a leanstream expert file (bad magic {h['magic']!r})")
        if h["version"] != EXPERT_VERSION:
            raise ValueError(f"{path}: expert file version {h['version']}, this build reads {EXPERT_VERSION} "
                             "(re-run `leanstream convert` with --force)")
        n, a, stride = h["n_expert"], h["align"], h["expert_stride"]
        payload = (h["gate_bytes"] + h["up_bytes"] + h["down_bytes"]
                   + expert_extra_bytes(h["flags"], h["n_embd"], h["n_ff_exp"]))
        flaw = ("zero dimension" if min(h["n_embd"], h["n_ff_exp"], n) <= 0 else
                "unknown flags" if h["flags"] & ~(EXPERT_BIASES | EXPERT_SCALES) else
                "alignment is not a power of two >= 512" if a < MIN_ALIGN or a & (a - 1) else
                "bad expert stride" if stride != (payload + a - 1) // a * a else
                "bad offsets" if h["table_offset"] != HEADER_BYTES or
                h["data_offset"] != (HEADER_BYTES + 8 * n + max(a, HEADER_BYTES) - 1) // max(a, HEADER_BYTES) * max(a, HEADER_BYTES) else
                "file_size field inconsistent" if h["file_size"] != h["data_offset"] + n * stride else None)
        if flaw:
            raise ValueError(f"{path}: layer {h['il']}: malformed expert file header: {flaw}")
        size = os.fstat(f.fileno()).st_size
        if size < h["file_size"]:
            raise ValueError(f"{path}: truncated expert file: {size} bytes, header says {h['file_size']}")
        meta = bytearray(head + f.read(h["data_offset"] - HEADER_BYTES))
    meta[EXPERT_META_CRC_OFFSET:EXPERT_META_CRC_OFFSET + 4] = bytes(4)
    if crc32c(meta) != h["meta_crc"]:
        raise ValueError(f"{path}: layer {h['il']}: header or tables corrupt (meta_crc)")
    t = h["table_offset"]
    h["expert_of_slot"] = np.frombuffer(bytes(meta[t:t + 4 * n]), dtype="<i4").copy()
    h["slot_crc"] = np.frombuffer(bytes(meta[t + 4 * n:t + 8 * n]), dtype="<u4").copy()
    if not np.array_equal(np.sort(h["expert_of_slot"]), np.arange(n)):
        raise ValueError(f"{path}: layer {h['il']}: expert_of_slot is not a permutation of the {n} experts")
    return h
