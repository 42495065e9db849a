"""Sketch file format version 1 (``sketch/blk.<il>.lssk``; layout in native/src/sketch.c).

A sketch is a 2-bit copy (row format LS2: 4 symmetric levels, one f16 scale per 32 values,
2.5 bits per value) of a layer's gate and up rows in the block file's slot order, held in RAM by
the engine: leanstream mode scores every neuron block from the layer's own input with it,
then computes exact gate/up rows only for the best-scored candidates and down columns only for
the blocks with the largest exact |h| (docs/design.md §12).

Standard library + numpy only: the format, the LS2 quantizer the converter uses, and the numpy
reference of the native scorer that the tests compare it to.
"""

from __future__ import annotations

import struct
from dataclasses import astuple, dataclass

import numpy as np

from leanstream_ggml.checksum import crc32c

LS2 = 1               # LS_SKETCH_LS2: the row format (native/src/sketch.c)
MAGIC = b"LSSKETCH"
VERSION = 1
HEADER_BYTES = 4096
_FMT = "<8sIIQQiIQQQQQII"     # magic .. meta_crc, 88 bytes
assert struct.calcsize(_FMT) == 88
META_CRC_OFFSET = 84


class SketchFileError(ValueError):
    pass


@dataclass
class SketchHeader:
    magic: bytes
    version: int
    il: int
    n_embd: int
    n_rows: int          # n_blocks * k (block file slot order)
    type: int            # enum ggml_type of the rows
    k: int
    row_bytes: int
    gate_offset: int     # 4096
    up_offset: int
    norm_offset: int     # f32 weight[n_rows]
    file_size: int
    data_crc: int = 0    # CRC-32C of [gate_offset, file_size)
    meta_crc: int = 0    # CRC-32C of [0, 4096) with this field zero

    def pack(self) -> bytes:
        return struct.pack(_FMT, *astuple(self)).ljust(HEADER_BYTES, b"\0")

    @classmethod
    def unpack(cls, buf: bytes, where: str = "sketch file") -> SketchHeader:
        if len(buf) < HEADER_BYTES:
            raise SketchFileError(f"{where}: too short for a sketch file header")
        h = cls(*struct.unpack_from(_FMT, buf))
        if h.magic != MAGIC:
            raise SketchFileError(f"{where}: bad magic {h.magic!r} (not a LeanStream sketch file)")
        if h.version != VERSION:
            raise SketchFileError(f"{where}: sketch file version {h.version}, expected {VERSION}")
        zeroed = bytearray(buf[:HEADER_BYTES])
        zeroed[META_CRC_OFFSET:META_CRC_OFFSET + 4] = b"\0\0\0\0"
        if crc32c(bytes(zeroed)) != h.meta_crc:
            raise SketchFileError(f"{where}: header checksum mismatch (corrupt file)")
        return h


def make_file(il: int, n_embd: int, k: int, type_id: int, gate: np.ndarray, up: np.ndarray,
              weight: np.ndarray) -> bytes:
    """The bytes of a sketch file: gate/up uint8 [n_rows, row_bytes] (quantized rows in slot
    order, zero rows for padding slots), weight f32 [n_rows]."""
    n_rows, row_bytes = gate.shape
    assert up.shape == gate.shape and weight.shape == (n_rows,)
    body = gate.tobytes() + up.tobytes() + np.asarray(weight, dtype="<f4").tobytes()
    go = HEADER_BYTES
    uo = go + n_rows * row_bytes
    no = uo + n_rows * row_bytes
    h = SketchHeader(MAGIC, VERSION, il, n_embd, n_rows, type_id, k, row_bytes, go, uo, no, no + 4 * n_rows,
                     data_crc=crc32c(body))
    h.meta_crc = crc32c(h.pack())
    return h.pack() + body


def read(path) -> tuple[SketchHeader, np.ndarray, np.ndarray, np.ndarray]:
    """(header, gate rows uint8 [n_rows, row_bytes], up rows, weight f32 [n_rows]), checked."""
    data = open(path, "rb").read()
    h = SketchHeader.unpack(data, str(path))
    if len(data) != h.file_size or h.norm_offset + 4 * h.n_rows != h.file_size:
        raise SketchFileError(f"{path}: {len(data)} bytes, header says {h.file_size}: truncated or corrupt")
    if crc32c(data[h.gate_offset:]) != h.data_crc:
        raise SketchFileError(f"{path}: data checksum mismatch (corrupt file)")
    rb, n = h.row_bytes, h.n_rows
    gate = np.frombuffer(data, np.uint8, n * rb, h.gate_offset).reshape(n, rb)
    up = np.frombuffer(data, np.uint8, n * rb, h.up_offset).reshape(n, rb)
    weight = np.frombuffer(data, "<f4", n, h.norm_offset)
    return h, gate, up, weight


# ---- LS2 rows ------------------------------------------------------------------------------------

_SCALE_TRIALS = np.linspace(0.35, 1.0, 27, dtype=np.float32)   # d = f * max|w| / 1.5


def row_bytes(n_embd: int) -> int:
    return n_embd * 5 // 16


def _codes(w: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Nearest level (code - 1.5) * d for every value: code = clip(floor(w / d + 2), 0, 3)."""
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    return np.clip(np.floor(w * inv + 2.0), 0, 3).astype(np.uint8)


def quantize_rows(w: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """uint8 [n_rows, row_bytes] LS2 rows of f32 w [n_rows, n_embd] (n_embd a multiple of 64).
    Each group of 32 values takes the scale, among a grid of trials, with the least squared error."""
    w = np.asarray(w, np.float32)
    n_rows, n = w.shape
    if n % 64:
        raise ValueError(f"LS2 sketch rows need n_embd a multiple of 64, got {n}")
    out = np.empty((n_rows, row_bytes(n)), np.uint8)
    for r0 in range(0, n_rows, chunk):
        g = w[r0:r0 + chunk].reshape(-1, n // 32, 32)                   # [r, G, 32]
        amax = np.abs(g).max(-1, keepdims=True) / 1.5
        best_err = np.full(amax.shape, np.inf, np.float32)
        best_d = np.zeros_like(amax)
        for f in _SCALE_TRIALS:
            d = (amax * f).astype(np.float16).astype(np.float32)
            v = (_codes(g, d).astype(np.float32) - 1.5) * d
            err = ((g - v) ** 2).sum(-1, keepdims=True)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_d = np.where(better, d, best_d)
        u = _codes(g, best_d).reshape(len(g), n // 64, 4, 16)            # [r, chunk, quarter, j]
        packed = u[:, :, 0] | (u[:, :, 1] << 2) | (u[:, :, 2] << 4) | (u[:, :, 3] << 6)
        out[r0:r0 + len(g), : n // 16] = best_d.reshape(len(g), -1).astype("<f2").view(np.uint8)
        out[r0:r0 + len(g), n // 16:] = packed.reshape(len(g), -1)
    return out


def dequantize_rows(rows: np.ndarray, n_embd: int) -> np.ndarray:
    """f32 [n_rows, n_embd] values of LS2 rows."""
    rows = np.asarray(rows, np.uint8)
    d = rows[:, : n_embd // 16].copy().view("<f2").astype(np.float32)        # [r, G]
    c = rows[:, n_embd // 16:].reshape(len(rows), n_embd // 64, 16)
    u = np.stack([(c >> s) & 3 for s in (0, 2, 4, 6)], axis=2)              # [r, chunk, quarter, j]
    v = u.reshape(len(rows), n_embd // 32, 32).astype(np.float32) - 1.5
    return (v * d[:, :, None]).reshape(len(rows), n_embd)


def round_x(x: np.ndarray) -> np.ndarray:
    """x [n_embd] as the scorer sees it: int8 per group of 32 with scale max|x| / 127."""
    b = np.asarray(x, np.float32).reshape(-1, 32)
    d = np.abs(b).max(-1, keepdims=True) / np.float32(127.0)
    inv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=d > 0)
    return (np.rint(b * inv) * d).reshape(-1)


def reference_scores(gate_rows: np.ndarray, up_rows: np.ndarray, weight: np.ndarray, x: np.ndarray,
                     k: int, act) -> np.ndarray:
    """Score of every block: sum over its k slots of |act(g~) * u~| * weight (float64), the numpy
    reference of the native scorer. act: the activation (reference.act)."""
    n = np.asarray(x).size
    xr = round_x(x).astype(np.float64)
    g = dequantize_rows(gate_rows, n).astype(np.float64) @ xr
    u = dequantize_rows(up_rows, n).astype(np.float64) @ xr
    s = np.abs(act(g) * u) * np.asarray(weight, np.float64)
    return s.reshape(-1, k).sum(1)
