"""Rows of a GGUF tensor through ggml's own type traits: dequantized by the type's to_float (every
type ggml has, bit for bit gguf-py's dequantize, 15-20x faster on Q4_K) and quantized by
ggml_quantize_chunk (gguf-py quantizes no K-quant), each in parts on several threads (ctypes lets
go of the GIL in the call; each row is done alone, so the bytes do not depend on the parts)."""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from leanstream_ggml.llamacpp import ggml_ctypes

_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)   # ggml_to_float_t


class RowsError(ValueError):
    """Rows that ggml cannot (de)quantize as asked."""


def _in_parts(n_rows: int, n_threads: int, fn) -> list:
    """fn(r0, r1) over n_threads contiguous parts of n_rows rows, at once; their results."""
    n = max(1, n_threads)
    parts = [(n_rows * i // n, n_rows * (i + 1) // n) for i in range(n)]
    if n == 1:
        return [fn(*parts[0])]
    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(lambda p: fn(*p) if p[1] > p[0] else 0, parts))


def dequantizes(ggml_type: int) -> bool:
    """Whether ``dequantize`` takes rows of this ggml type (F32 as they are; others by a to_float)."""
    return int(ggml_type) == 0 or bool(ggml_ctypes.base().ggml_get_type_traits(int(ggml_type)).contents.to_float)


def to_float(rows: np.ndarray, ggml_type: int, n_per_row: int, n_threads: int = 2) -> np.ndarray:
    """f32 [n_rows, n_per_row]: rows (uint8 [n_rows, row bytes], as stored) of ggml type
    ``ggml_type`` dequantized by ggml's to_float."""
    tr = ggml_ctypes.base().ggml_get_type_traits(int(ggml_type)).contents
    if not tr.to_float or n_per_row % tr.blck_size:
        raise RowsError(f"ggml type {ggml_type} ({tr.type_name}): no to_float for rows of {n_per_row} values")
    src = np.ascontiguousarray(rows, dtype=np.uint8)
    n_rows = src.shape[0]
    if src.size != n_rows * (n_per_row // tr.blck_size) * tr.type_size:
        raise RowsError(f"{src.size} bytes are not {n_rows} rows of {n_per_row} {tr.type_name.decode()} values")
    out = np.empty((n_rows, n_per_row), dtype=np.float32)
    fn = _TO_FLOAT(tr.to_float)
    _in_parts(n_rows, n_threads, lambda r0, r1: fn(src[r0:r1].ctypes.data, out[r0:r1].ctypes.data,
                                                   (r1 - r0) * n_per_row))
    return out


def dequantize(t, n_rows: int, n_threads: int = 2, order: np.ndarray | None = None) -> np.ndarray:
    """f32 [n_rows, row length]: a gguf-py tensor's rows (F32 as they are; any other type by
    ggml's to_float), the rows of index array ``order`` in its order if given (the stored rows
    gathered first: a copy of a fraction of the f32 rows' bytes)."""
    import gguf

    if t.tensor_type == gguf.GGMLQuantizationType.F32:
        w = np.asarray(t.data, dtype=np.float32).reshape(n_rows, -1)
        return w if order is None else w[order]
    raw = t.data.view(np.uint8).reshape(n_rows, -1)
    raw = raw if order is None else raw[order]
    n_per_row = int(np.prod([int(x) for x in t.shape])) // n_rows
    return to_float(raw, int(t.tensor_type), n_per_row, n_threads)


def quantize(cols: np.ndarray, type_name: str, n_threads: int = 2) -> np.ndarray:
    """f32 [n, m] rows quantized by ggml's own quantizer (ggml_quantize_chunk, no importance
    matrix) -> uint8 [n, row bytes]."""
    import gguf

    qt = gguf.GGMLQuantizationType[type_name.upper()]
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    n, m = cols.shape
    f = ggml_ctypes.base().ggml_quantize_chunk
    src = np.ascontiguousarray(cols, dtype=np.float32)
    out = np.empty((n, m // bs * ts), dtype=np.uint8)
    done = sum(_in_parts(n, n_threads, lambda r0, r1: f(int(qt), src.ctypes.data, out.ctypes.data, r0 * m,
                                                        r1 - r0, m, None)))
    if done != out.nbytes:
        raise RowsError(f"ggml_quantize_chunk({type_name}) wrote {done} bytes, expected {out.nbytes}")
    return out
