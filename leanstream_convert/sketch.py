"""The sketch stage: a low-bit copy of every layer's gate and up rows (leanstream mode's
exact-input scorer), written to ``sketch/blk.<il>.lssk`` in the block files' slot order; and the
sketch file (format version 1) and its LS2 rows, as the converter writes and reads them back.
The format is specified in docs/formats.md; the engine reads the files itself (native/src/sketch.c).

No training: the rows are dequantized by ggml and re-quantized to 2-bit LS2 rows (4
symmetric levels, one f16 scale per 32 values, 2.5 bits per value; by the native library,
``quantize_rows`` is its numpy reference), so a conversion is ready for
sparse decode in the time it takes to read the FFN once. Resumable per layer: a complete file
from an interrupted run is kept.
"""

from __future__ import annotations

import struct
from dataclasses import astuple, dataclass
from pathlib import Path

import numpy as np

from leanstream_ggml.model import manifest as mf
from leanstream_ggml.model.formats import HEADER_BYTES
from leanstream_ggml.model.formats import SKETCH_LS2 as LS2
from leanstream_ggml.model.formats import SKETCH_MAGIC as MAGIC
from leanstream_ggml.model.formats import SKETCH_VERSION as VERSION

from ._faults import kill_point
from .fileio import atomic_writer, fsync_dir

TYPES = mf.SKETCH_TYPES   # what --sketch accepts ("none": no sketch)
DEFAULT_TYPE = TYPES[0]
WEIGHTS = mf.SKETCH_WEIGHTS
DEFAULT_WEIGHT = "one"    # ranking by |h| alone measured as good or better (docs/design.md §12)

# ---- the sketch file (docs/formats.md) -----------------------------------------------------------

# magic, version, header size and row format: leanstream_ggml/model/formats.py (HEADER_BYTES, LS2, MAGIC, VERSION)
_FMT = "<8sIIQQiIQQQQQII"     # magic .. meta_crc, 88 bytes
assert struct.calcsize(_FMT) == 88
META_CRC_OFFSET = 84


class SketchFileError(ValueError):
    pass


def crc32c(data: bytes) -> int:
    """CRC-32C of data by the native library (the CPU's CRC instruction: a 7B's 27 MB sketch
    bodies took 3.4 s a layer with the byte-at-a-time reference, leanstream_ggml.model.checksum.crc32c,
    which tests/native holds it to)."""
    from leanstream_ggml.native.capi import ffi, lib

    return int(lib.ls_crc32c(0, ffi.from_buffer(data), len(data)))


@dataclass
class SketchHeader:
    magic: bytes
    version: int
    il: int
    n_embd: int
    n_rows: int          # n_blocks * k (block file slot order)
    type: int            # the row format (LS2)
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
    if crc32c(memoryview(data)[h.gate_offset:]) != h.data_crc:
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


def quantize_rows_native(w: np.ndarray, n_threads: int = 2) -> np.ndarray:
    """quantize_rows by the native library (ls_sketch_quantize_ls2, on n_threads threads): the same
    rows (tests/native/test_sketch.py holds it to quantize_rows), ~10x faster."""
    from leanstream_ggml.native.capi import ffi, lib

    w = np.ascontiguousarray(w, np.float32)
    n_rows, n = w.shape
    if n % 64:
        raise ValueError(f"LS2 sketch rows need n_embd a multiple of 64, got {n}")
    out = np.empty((n_rows, row_bytes(n)), np.uint8)
    lib.ls_sketch_quantize_ls2(ffi.cast("const float *", w.ctypes.data), n_rows, n, ffi.cast("uint8_t *", out.ctypes.data),
                               n_threads)
    return out


def quantize_rows(w: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """uint8 [n_rows, row_bytes] LS2 rows of f32 w [n_rows, n_embd] (n_embd a multiple of 64).
    Each group of 32 values takes the scale, among a grid of trials, with the least squared error.
    The reference of quantize_rows_native, which the converter runs."""
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


# ---- the stage -----------------------------------------------------------------------------------

def _dequantized_rows(t, n_rows: int, order: np.ndarray | None = None) -> np.ndarray:
    """f32 rows of tensor t (n_rows of them), in ``order`` if given (the stored rows gathered
    first: a copy of a fraction of the f32 rows' bytes)."""
    from .ggml_rows import dequantize

    return dequantize(t, n_rows, order=order)


def down_column_norms(layer, n_embd: int) -> np.ndarray:
    """f32 [n_ff]: ||down column|| of each of the layer's neurons, GGUF order."""
    return np.linalg.norm(_dequantized_rows(layer.down, n_embd), axis=0).astype(np.float32)


def _layer_sketch(layer, slots: np.ndarray, n_embd: int, n_ff: int, k: int, weight: str, n_threads: int = 2) -> bytes:
    pad = slots < 0
    idx = np.where(pad, 0, slots)
    parts = []
    for t in (layer.gate, layer.up):
        rows = _dequantized_rows(t, n_ff, idx)         # f32 [n_rows, n_embd], slot order
        rows[pad] = 0.0
        parts.append(quantize_rows_native(rows, n_threads))
    if weight == "down_norm":
        down = _dequantized_rows(layer.down, n_embd)   # [n_embd, n_ff]
        w = np.linalg.norm(down, axis=0)[idx].astype(np.float32)
    else:
        w = np.ones(len(slots), dtype=np.float32)
    w[pad] = 0.0
    return make_file(layer.il, n_embd, k, LS2, parts[0], parts[1], w)


def _complete(path: Path, il: int, n_rows: int) -> bool:
    try:
        h, *_ = read(path)
    except (OSError, ValueError):
        return False
    return h.il == il and h.n_rows == n_rows and h.type == LS2


def write_sketches(source, out: Path, *, type_name: str = DEFAULT_TYPE, weight: str = DEFAULT_WEIGHT,
                   progress: bool = True, block_freq: np.ndarray | None = None,
                   block_abs_h: np.ndarray | None = None, down_norm: np.ndarray | None = None,
                   n_threads: int = 2) -> mf.SketchInfo:
    """Write one sketch file per layer (a complete one from an interrupted run is kept), and
    block_freq (f32 [n_layer, n_blocks], the order stage's calibration frequencies) if given; with
    block_abs_h (the order stage's mean |h| per block, k = 1) the blocks' importance, mean |h| x
    ||down column|| (dense mode's pinned set: the draft FFN of speculative decoding); down_norm
    f32 [n_layer, n_blocks]: those norms in slot order, where the order stage has them."""
    from tqdm import tqdm

    if type_name not in TYPES:
        raise ValueError(f"sketch type must be one of {', '.join(TYPES)}, got {type_name!r}")
    if weight not in WEIGHTS:
        raise ValueError(f"sketch weight must be one of {', '.join(WEIGHTS)}, got {weight!r}")
    model = source.model
    if model.n_embd % 64:
        raise ValueError(f"the {type_name} sketch needs n_embd a multiple of 64, this model has {model.n_embd}; "
                         f"convert with --sketch none (dense mode) or with predictors")
    (out / mf.SKETCH_DIR).mkdir(exist_ok=True)
    files, total = [], 0
    importance = []
    for layer in tqdm(model.layers, desc=f"writing {type_name} sketches", unit="layer", disable=not progress):
        rel = mf.SKETCH_FILE.format(il=layer.il)
        path = out / rel
        slots = source.slots(layer.il)
        if not _complete(path, layer.il, len(slots)):
            data = _layer_sketch(layer, slots, model.n_embd, model.n_ff, source.k, weight, n_threads)
            with atomic_writer(path, durable=False) as f:
                f.write(data)
            model.release_pages()
            kill_point("sketch-layer")
        if block_abs_h is not None and source.k == 1:
            if down_norm is not None:      # the order stage's, in slot order
                importance.append(block_abs_h[layer.il] * down_norm[layer.il])
            else:
                norm = down_column_norms(layer, model.n_embd)   # [n_ff], GGUF order
                importance.append(block_abs_h[layer.il] * norm[np.where(slots < 0, 0, slots)].astype(np.float32))
        files.append(rel)
        total += path.stat().st_size
    freq_rel = None
    if block_freq is not None:
        freq_rel = mf.SKETCH_BLOCK_FREQ
        with atomic_writer(out / freq_rel, durable=False) as f:
            np.save(f, np.ascontiguousarray(block_freq, dtype=np.float32), allow_pickle=False)
    imp_rel = None
    if importance:
        imp_rel = mf.SKETCH_IMPORTANCE
        with atomic_writer(out / imp_rel, durable=False) as f:
            np.save(f, np.ascontiguousarray(np.stack(importance), dtype=np.float32), allow_pickle=False)
    fsync_dir(out / mf.SKETCH_DIR)
    return mf.SketchInfo(files=files, type=type_name, weight=weight, bytes=total, block_freq=freq_rel,
                         block_importance=imp_rel)
