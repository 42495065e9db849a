"""Block files as the converter writes and reads them back (format: docs/formats.md).

The header and its checks are the runtime's (``leanstream_ggml/model/blockfile.py``: BlockHeader,
check_meta, the constants); here: the geometry of a layer's file (``make_header``), the bytes
before its blocks (``pack_meta``), and reading a file back (header, perm table, one block).
The blocks themselves are packed by the write stage (``convert_gguf.pack_blocks``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

# the runtime's header and its check, used here and through this module by the converter
from leanstream_ggml.model.blockfile import HEADER_BYTES, MAGIC, PERM_OFFSET, VERSION, BlockHeader, check_meta  # noqa: F401
from leanstream_ggml.model.checksum import crc32c


def round_up(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def make_header(*, il: int, n_embd: int, n_ff: int, k: int, gate_type: int, up_type: int, down_type: int,
                align: int, gate_row_bytes: int, up_row_bytes: int, down_col_bytes: int) -> BlockHeader:
    """The geometry of one layer's block file."""
    n_blocks = -(-n_ff // k)
    stride = round_up(k * (gate_row_bytes + up_row_bytes + down_col_bytes), align)
    crc_offset = PERM_OFFSET + 4 * n_blocks * k
    # data_offset: past the header and the tables, a multiple of HEADER_BYTES and of align (both powers of 2)
    data_offset = round_up(crc_offset + 4 * n_blocks, max(HEADER_BYTES, align))
    return BlockHeader(MAGIC, VERSION, il, n_embd, n_ff, k, n_blocks, gate_type, up_type, down_type, align,
                       gate_row_bytes, up_row_bytes, down_col_bytes, stride, PERM_OFFSET, data_offset,
                       data_offset + n_blocks * stride, crc_offset)


def pack_meta(h: BlockHeader, slots: np.ndarray, crcs: np.ndarray) -> tuple[BlockHeader, bytes]:
    """(header with meta_crc set, bytes [0, data_offset): header, perm table, checksum table, zeros).
    crcs: u32 [n_blocks], the CRC-32C of each block's block_stride bytes."""
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
