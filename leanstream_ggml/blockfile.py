"""Block file format version 2 (the layout is specified in native/include/leanstream.h).

One file per layer, ``ffn/blk.<il>.bin``, little-endian::

    [0, 4096)                        header (124 bytes of fields, then zeros)
    [4096, crc_offset)               i32 perm[n_blocks*k]: neuron id of slot j of block b, -1 = padding
    [crc_offset, +4*n_blocks)        u32 block_crc[n_blocks]: CRC-32C of each block's stride bytes
    data_offset + b*block_stride     block b = [k gate rows][k up rows][k down columns][zero padding]

The header's meta_crc is the CRC-32C of [0, data_offset) with the meta_crc field read as zero.

This module only packs/unpacks the header and computes the geometry; it needs the standard library
and numpy (for ``read_block``), never gguf.
"""

from __future__ import annotations

import struct
from dataclasses import astuple, dataclass, replace

import numpy as np

from leanstream_ggml.checksum import crc32c, crc32c_rows

MAGIC = b"LSBLOCKS"
VERSION = 2            # LS_BLOCK_FILE_VERSION
HEADER_BYTES = 4096
PERM_OFFSET = 4096
_FMT = "<8sIIQQIIiiiIQQQQQQQQI"   # fields of leanstream.h, in order; 124 bytes
assert struct.calcsize(_FMT) == 124
META_CRC_OFFSET = 120


class BlockFileError(ValueError):
    pass


def round_up(x: int, n: int) -> int:
    return (x + n - 1) // n * n


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
    meta_crc: int = 0      # CRC-32C of [0, data_offset) with this field zero (set by pack_meta)

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


def make_header(*, il: int, n_embd: int, n_ff: int, k: int, gate_type: int, up_type: int, down_type: int,
                align: int, gate_row_bytes: int, up_row_bytes: int, down_col_bytes: int) -> BlockHeader:
    """The geometry of one layer's block file."""
    n_blocks = -(-n_ff // k)
    stride = round_up(k * (gate_row_bytes + up_row_bytes + down_col_bytes), align)
    crc_offset = PERM_OFFSET + 4 * n_blocks * k
    # data_offset: past the header and the tables, a multiple of 4096 and of align (both powers of 2)
    data_offset = round_up(crc_offset + 4 * n_blocks, max(4096, align))
    return BlockHeader(MAGIC, VERSION, il, n_embd, n_ff, k, n_blocks, gate_type, up_type, down_type, align,
                       gate_row_bytes, up_row_bytes, down_col_bytes, stride, PERM_OFFSET, data_offset,
                       data_offset + n_blocks * stride, crc_offset)


def block_checksums(blocks: np.ndarray) -> np.ndarray:
    """uint32 [n_blocks]: CRC-32C of each block (rows of uint8 [n_blocks, block_stride])."""
    return crc32c_rows(blocks)


def pack_meta(h: BlockHeader, slots: np.ndarray, crcs: np.ndarray) -> tuple[BlockHeader, bytes]:
    """(header with meta_crc set, bytes [0, data_offset): header, perm table, checksum table, zeros)."""
    h = replace(h, meta_crc=0)
    buf = bytearray(h.data_offset)
    buf[:HEADER_BYTES] = h.pack()
    perm = np.asarray(slots, dtype="<i4").tobytes()
    buf[h.perm_offset:h.perm_offset + len(perm)] = perm
    crc = np.asarray(crcs, dtype="<u4").tobytes()
    buf[h.crc_offset:h.crc_offset + len(crc)] = crc
    h = replace(h, meta_crc=crc32c(buf))
    buf[:HEADER_BYTES] = h.pack()
    return h, bytes(buf)


def read_crcs(path, h: BlockHeader) -> np.ndarray:
    """u32 [n_blocks]: the stored CRC-32C of each block."""
    return np.fromfile(path, dtype="<u4", count=h.n_blocks, offset=h.crc_offset)


def check_meta(meta: bytes, h: BlockHeader) -> bool:
    """meta = bytes [0, data_offset) of the file: does it match its meta_crc?"""
    b = bytearray(meta)
    b[META_CRC_OFFSET:META_CRC_OFFSET + 4] = b"\0\0\0\0"
    return crc32c(b) == h.meta_crc


def read_header(path) -> BlockHeader:
    with open(path, "rb") as f:
        return BlockHeader.unpack(f.read(HEADER_BYTES), where=str(path))


def read_perm(path, h: BlockHeader) -> np.ndarray:
    """i32 [n_blocks * k] neuron ids by slot (-1: padding)."""
    return np.fromfile(path, dtype="<i4", count=h.n_blocks * h.k, offset=h.perm_offset)


def read_block(path, h: BlockHeader, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw bytes of block b: (gate [k, gate_row_bytes], up [k, up_row_bytes], down [k, down_col_bytes])."""
    raw = np.fromfile(path, dtype=np.uint8, count=h.block_stride, offset=h.data_offset + b * h.block_stride)
    k, g, u, d = h.k, h.gate_row_bytes, h.up_row_bytes, h.down_col_bytes
    gate = raw[: k * g].reshape(k, g)
    up = raw[k * g: k * (g + u)].reshape(k, u)
    down = raw[k * (g + u): k * (g + u + d)].reshape(k, d)
    return gate, up, down
