"""Block file format version 2: the header as the runtime reads it (docs/formats.md).

One file per layer, ``ffn/blk.<il>.bin``, little-endian: a 4096-byte header, the perm and block
checksum tables, then the blocks at ``data_offset``. The engine reads these files itself
(native/src/blockfile.c); this module unpacks the header and checks the tables' CRC for
`leanstream verify`. The writer is the converter's (converters/blockfile.py).
"""

from __future__ import annotations

import struct
from dataclasses import astuple, dataclass

from leanstream_ggml.checksum import crc32c
from leanstream_ggml.formats import BLOCK_MAGIC as MAGIC
from leanstream_ggml.formats import BLOCK_VERSION as VERSION
from leanstream_ggml.formats import HEADER_BYTES

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
