"""Expert files as the converter writes them (format: docs/formats.md "Expert file").

One file per mixture-of-experts layer, ``experts/blk.<il>.bin``: a 4096-byte header, the
expert_of_slot and slot_crc tables, then one slot per expert holding its gate, up and down rows
in the GGUF's own types and bytes. ``write_expert_file`` takes the experts one at a time from a
callback (one expert in RAM at a time, whatever the layer's size), writes under a temporary name
and renames. The runtime reads the header back (``leanstream_ggml.model.blockfile.read_expert_header``) and
the engine reads the slots (native/src/blockfile.c, io.c).
"""

from __future__ import annotations

import struct
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from leanstream_ggml.model.checksum import crc32c
from leanstream_ggml.model.formats import (EXPERT_HEADER_FIELDS, EXPERT_MAGIC, EXPERT_META_CRC_OFFSET, EXPERT_VERSION,
                                           HEADER_BYTES, MIN_ALIGN, expert_extra_bytes)

from .fileio import atomic_writer

_FMT = "<" + "".join(code for _, code in EXPERT_HEADER_FIELDS)


def round_up(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def row_size(ggml_type: int, n: int) -> int:
    """Bytes of one row of n values of a ggml type (ggml_row_size)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if n % block:
        raise ValueError(f"{GGMLQuantizationType(ggml_type).name} rows need a multiple of {block} values, got {n}")
    return n // block * size


def expert_header(*, il: int, n_embd: int, n_ff_exp: int, n_expert: int, gate_type: int, up_type: int,
                  down_type: int, align: int, flags: int = 0) -> dict:
    """The header fields of one layer's expert file (meta_crc 0: set when the tables are known);
    flags: EXPERT_BIASES | EXPERT_SCALES, the f32 extras a slot starts with."""
    if align < MIN_ALIGN or align & (align - 1):
        raise ValueError(f"align must be a power of two >= {MIN_ALIGN}, got {align}")
    gate_bytes = n_ff_exp * row_size(gate_type, n_embd)
    up_bytes = n_ff_exp * row_size(up_type, n_embd)
    down_bytes = n_embd * row_size(down_type, n_ff_exp)
    stride = round_up(expert_extra_bytes(flags, n_embd, n_ff_exp) + gate_bytes + up_bytes + down_bytes, align)
    table_offset = HEADER_BYTES
    data_offset = round_up(table_offset + 8 * n_expert, max(HEADER_BYTES, align))
    return dict(magic=EXPERT_MAGIC, version=EXPERT_VERSION, il=il, n_embd=n_embd, n_ff_exp=n_ff_exp,
                n_expert=n_expert, align=align, gate_type=gate_type, up_type=up_type, down_type=down_type,
                flags=flags, gate_bytes=gate_bytes, up_bytes=up_bytes, down_bytes=down_bytes, expert_stride=stride,
                table_offset=table_offset, data_offset=data_offset, file_size=data_offset + n_expert * stride,
                meta_crc=0)


def pack_meta(h: dict, expert_of_slot: np.ndarray, slot_crc: np.ndarray) -> tuple[dict, bytes]:
    """(the header with meta_crc set, bytes [0, data_offset): header, tables, zeros)."""
    h = dict(h, meta_crc=0)
    buf = bytearray(h["data_offset"])
    n = h["n_expert"]
    t = h["table_offset"]
    buf[t:t + 4 * n] = np.asarray(expert_of_slot, dtype="<i4").tobytes()
    buf[t + 4 * n:t + 8 * n] = np.asarray(slot_crc, dtype="<u4").tobytes()
    buf[:struct.calcsize(_FMT)] = struct.pack(_FMT, *(h[name] for name, _ in EXPERT_HEADER_FIELDS))
    h["meta_crc"] = crc32c(buf)
    struct.pack_into("<I", buf, EXPERT_META_CRC_OFFSET, h["meta_crc"])
    return h, bytes(buf)


def write_expert_file(path, *, il: int, n_embd: int, n_ff_exp: int, gate_type: int, up_type: int, down_type: int,
                      expert: Callable[[int], tuple], expert_of_slot, align: int, flags: int = 0) -> dict:
    """Write layer il's expert file at ``path``; returns its header fields.

    expert(e) -> (gate, up, down) uint8 arrays of router expert e's bytes as the GGUF holds them:
    gate [n_ff_exp * row_size(gate_type, n_embd)], up likewise, down [n_embd * row_size(down_type,
    n_ff_exp)], and with flags a 4th: f32 extras (biases, then scales; formats.EXPERT_BIASES,
    EXPERT_SCALES). expert_of_slot: the router index of each slot, a permutation of range(n_expert)
    (the co-activation order). Slots are written in that order, one expert in RAM at a time; the
    tables (and their checksums) are written last, over the zeros the file starts with."""
    order = np.asarray(expert_of_slot, dtype=np.int64).reshape(-1)
    n_expert = len(order)
    if n_expert == 0 or sorted(order.tolist()) != list(range(n_expert)):
        raise ValueError(f"layer {il}: expert_of_slot must be a permutation of range({n_expert})")
    h = expert_header(il=il, n_embd=n_embd, n_ff_exp=n_ff_exp, n_expert=n_expert, gate_type=gate_type,
                      up_type=up_type, down_type=down_type, align=align, flags=flags)
    extra = expert_extra_bytes(flags, n_embd, n_ff_exp)
    sizes = (h["gate_bytes"], h["up_bytes"], h["down_bytes"])
    stride = h["expert_stride"]
    crcs = np.zeros(n_expert, dtype=np.uint32)
    with atomic_writer(path) as f:
        f.write(bytes(h["data_offset"]))            # header and tables: rewritten at the end
        for s, e in enumerate(order.tolist()):
            parts = expert(e)
            slot = bytearray(stride)
            if flags:
                f32 = np.ascontiguousarray(parts[3], dtype="<f4").reshape(-1).tobytes()
                if len(f32) > extra or extra - len(f32) >= 64:
                    raise ValueError(f"layer {il} expert {e}: {len(f32)} bytes of biases and scales, flags {flags} "
                                     f"need {extra} (padded)")
                slot[:len(f32)] = f32
            off = extra
            for what, part, size in zip(("gate", "up", "down"), parts[:3], sizes):
                raw = np.ascontiguousarray(part, dtype=np.uint8).reshape(-1)
                if raw.size != size:
                    raise ValueError(f"layer {il} expert {e}: {what} has {raw.size} bytes, the types need {size}")
                slot[off:off + size] = raw.tobytes()
                off += size
            crcs[s] = crc32c_slot(slot)
            f.write(slot)
        h, meta = pack_meta(h, order, crcs)
        f.seek(0)
        f.write(meta)
    return h


def crc32c_slot(slot: bytes | bytearray) -> int:
    """CRC-32C of one slot's bytes (padding included): the library's ls_crc32c, which runs the
    CPU's CRC instructions (an expert is megabytes; checksum.crc32c is a byte-at-a-time
    reference, and tests compare the two)."""
    from leanstream_ggml.native.capi import ffi, lib

    buf = ffi.from_buffer(slot)
    return int(lib.ls_crc32c(0, buf, len(slot)))
