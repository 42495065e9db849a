"""The predictor file (``predictor/blk.<il>.lspred``, format version 2; specified in
docs/formats.md): writing it, reading it back, and the handle of the C evaluator that the
training scores the exported file with. numpy only (torch stays in hashing.py); the engine reads
and evaluates the files itself (native/src/predictor.c).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

from leanstream_ggml.model.formats import PREDICTOR_HEADER_BYTES as HEADER_SIZE
from leanstream_ggml.model.formats import PREDICTOR_MAGIC as MAGIC
from leanstream_ggml.model.formats import PREDICTOR_VERSION as FILE_VERSION

from ..fileio import atomic_write_bytes

READS_VERSIONS = (1, FILE_VERSION)   # version 1 = version 2 with skip_weight 1
ALIGN = 64
HDR = struct.Struct("<8sIIIIIIIIIiQII")


class PredictorFormatError(ValueError):
    """A predictor file is malformed, truncated or of another version."""


def crc32(data) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def layout(n_embd, n_blocks, n_pca, L, tau, n_bits, M):
    """[(name, dtype, shape)] in file order."""
    w = n_bits // 64
    mt, kk = M * tau, 1 << tau
    secs = [("in_mean", "<f4", (n_embd,)), ("in_scale", "<f4", (n_embd,)),
            ("pca_q", "i1", (n_pca, n_embd)), ("pca_scale", "<f4", (n_pca,)),
            ("hp1_q", "i1", (mt, n_pca)), ("hp1_scale", "<f4", (mt,)), ("hp1_bias", "<f4", (mt,)),
            ("table_1", "<u8", (M * kk, w))]
    for k in range(2, L + 1):
        secs += [(f"hp_{k}", "<u8", (mt, w)), (f"thr_{k}", "<i4", (mt,)), (f"table_{k}", "<u8", (M * kk, w))]
    secs += [("head_w", "<u8", (n_blocks, w)), ("head_a", "<f4", (n_blocks,)), ("head_c", "<f4", (n_blocks,))]
    return secs


def unpack_signs(p: np.ndarray, n_bits: int) -> np.ndarray:
    """[R, n_bits/64] uint64 -> [R, n_bits] float64 in {-1, +1} (bit k of word k/64 set = +1)."""
    r = p.shape[0]
    b = np.unpackbits(np.ascontiguousarray(p).view(np.uint8).reshape(r, -1, 1), axis=-1)[:, :, ::-1]
    return np.where(b.reshape(r, n_bits) > 0, 1.0, -1.0)


# ---- writing ---------------------------------------------------------------------------------------

def _flat(params: dict) -> dict:
    out = {k: params[k] for k in ("in_mean", "in_scale", "pca_q", "pca_scale", "hp1_q", "hp1_scale",
                                  "hp1_bias", "head_w", "head_a", "head_c")}
    for k, t in enumerate(params["tables"], start=1):
        out[f"table_{k}"] = t
    for k, (hp, thr) in enumerate(zip(params["hp"], params["thr"]), start=2):
        out[f"hp_{k}"], out[f"thr_{k}"] = hp, thr
    return out


def serialize(params: dict, *, tau: int, n_tables: int, layer: int = -1) -> bytes:
    n_pca, n_embd = params["pca_q"].shape
    n_blocks, w = params["head_w"].shape
    L = len(params["tables"])
    flat = _flat(params)
    body = bytearray()
    for name, dt, shape in layout(n_embd, n_blocks, n_pca, L, tau, w * 64, n_tables):
        a = np.ascontiguousarray(flat[name], dtype=dt)
        if a.shape != shape:
            raise ValueError(f"{name}: shape {a.shape}, expected {shape}")
        body += a.tobytes()
        body += b"\0" * (-len(body) % ALIGN)
    size = HEADER_SIZE + len(body)
    hdr = HDR.pack(MAGIC, FILE_VERSION, HEADER_SIZE, n_embd, n_blocks, n_pca, L, tau, w * 64,
                    n_tables, layer, size, crc32(body), int(params.get("skip_weight", 1)))
    return hdr + b"\0" * (HEADER_SIZE - len(hdr)) + bytes(body)


def write_predictor(path, params: dict, *, tau: int, n_tables: int, layer: int = -1) -> int:
    """Write atomically (temporary name, then rename). Returns the file size in bytes."""
    data = serialize(params, tau=tau, n_tables=n_tables, layer=layer)
    atomic_write_bytes(Path(path), data)
    return len(data)


# ---- reading back ------------------------------------------------------------------------------------

def _nest(flat: dict, L: int) -> dict:
    p = {k: v for k, v in flat.items() if not k.startswith(("table_", "hp_", "thr_"))}
    p["tables"] = [flat[f"table_{k}"] for k in range(1, L + 1)]
    p["hp"] = [flat[f"hp_{k}"] for k in range(2, L + 1)]
    p["thr"] = [flat[f"thr_{k}"] for k in range(2, L + 1)]
    return p


def parse(data: bytes, *, check_payload: bool = True) -> tuple[dict, dict]:
    """bytes of a predictor file -> (header dict, nested params). Treats the input as hostile."""
    if len(data) < HEADER_SIZE:
        raise PredictorFormatError(f"predictor file truncated: {len(data)} bytes, header needs {HEADER_SIZE}")
    (magic, version, hsize, n_embd, n_blocks, n_pca, L, tau, n_bits, M, layer, size,
     crc, skip) = HDR.unpack_from(data)
    if magic != MAGIC:
        raise PredictorFormatError(f"not a leanstream predictor file (magic {magic!r})")
    if version not in READS_VERSIONS:
        raise PredictorFormatError(f"predictor file version {version}, this build reads versions "
                                   f"{', '.join(map(str, READS_VERSIONS))}: retrain (leanstream train-predictor)")
    if version == 1:
        skip = 1
    if not 1 <= skip <= 1024:
        raise PredictorFormatError(f"predictor header has out-of-range skip weight {skip}")
    if hsize != HEADER_SIZE:
        raise PredictorFormatError(f"bad header size {hsize}")
    if not (0 < n_embd <= 1 << 16 and 0 < n_blocks <= 1 << 24 and 0 < n_pca <= n_embd
            and 1 <= L <= 64 and 1 <= tau <= 12 and n_bits % 64 == 0 and 0 < n_bits <= 8192
            and 1 <= M <= 256):
        raise PredictorFormatError("predictor header has out-of-range dimensions")
    if size != len(data):
        raise PredictorFormatError(f"predictor file truncated or padded: header says {size} bytes, got {len(data)}")
    sections = layout(n_embd, n_blocks, n_pca, L, tau, n_bits, M)
    off = HEADER_SIZE
    flat = {}
    for name, dt, shape in sections:
        nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize
        if off + nbytes > len(data):
            raise PredictorFormatError(f"predictor file truncated in section {name}")
        flat[name] = np.frombuffer(data, dtype=dt, count=int(np.prod(shape)), offset=off).reshape(shape).astype(dt)
        off += nbytes + (-nbytes % ALIGN)
    if off != size:
        raise PredictorFormatError(f"predictor file size {size} does not match its layout ({off})")
    if check_payload and crc32(memoryview(data)[HEADER_SIZE:]) != crc:
        raise PredictorFormatError("predictor file payload checksum mismatch (corrupted)")
    p = _nest(flat, L)
    w = n_bits // 64
    p["tables"] = [t.reshape(M * (1 << tau), w) for t in p["tables"]]
    p["skip_weight"] = int(skip)
    hdr = dict(version=version, skip_weight=int(skip), n_embd=n_embd, n_blocks=n_blocks, n_pca=n_pca, n_hash_layers=L,
               tau=tau, n_bits=n_bits, n_tables=M, layer=layer, file_size=size)
    return hdr, p


def read_predictor(path) -> tuple[dict, dict]:
    return parse(Path(path).read_bytes())


# ---- the C evaluator ---------------------------------------------------------------------------------

class NativePredictor:
    """One loaded `blk.<il>.lspred` in the engine's evaluator (native/src/predictor.c); `close()`
    (or `with`) frees the C handle."""

    def __init__(self, source):
        from leanstream_ggml.native.capi import check, ffi, lib

        self._ffi, self._lib = ffi, lib
        out = ffi.new("ls_predictor **")
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
            check(lib.ls_predictor_load_mem(ffi.from_buffer(data), len(data), out), "ls_predictor_load_mem")
        else:
            check(lib.ls_predictor_load(str(Path(source)).encode(), out), "ls_predictor_load")
        self._h = out[0]
        info = ffi.new("ls_predictor_info *")
        check(lib.ls_predictor_get_info(self._h, info))
        self.info = {k: getattr(info, k) for k in ("n_embd", "n_blocks", "n_pca", "n_hash_layers", "tau",
                                                   "n_bits", "n_tables", "layer", "size_bytes")}
        self.n_embd, self.n_blocks = self.info["n_embd"], self.info["n_blocks"]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x [n, n_embd] (or [n_embd]) f32 -> priorities [n, n_blocks] (or [n_blocks]) f32."""
        from leanstream_ggml.native.capi import check

        x = np.ascontiguousarray(x, dtype=np.float32)
        one = x.ndim == 1
        x2 = x.reshape(-1, self.n_embd)
        out = np.empty((x2.shape[0], self.n_blocks), dtype=np.float32)
        check(self._lib.ls_predictor_eval_batch(self._h, self._ffi.from_buffer("float[]", x2),
                                                self._ffi.from_buffer("float[]", out), self.n_blocks,
                                                x2.shape[0]), "ls_predictor_eval")
        return out[0] if one else out

    def eval_into(self, x_ptr, prio_ptr) -> int:
        """Raw single call (for latency benchmarks): cffi pointers in, status out."""
        return self._lib.ls_predictor_eval(self._h, x_ptr, prio_ptr, self.n_blocks)

    def close(self):
        if getattr(self, "_h", None) is not None:
            self._lib.ls_predictor_free(self._h)
            self._h = None

    __del__ = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
