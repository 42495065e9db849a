"""Predictor files: their format, a numpy reference of their inference, and the owner of the C
evaluator (native/src/predictor.c). numpy only: the runtime reads these files, training (torch,
``converters/train/``) writes them.

File format (version 2): one file per FFN layer, `predictor/blk.<il>.lspred`, little-endian.
A 256-byte header, then sections in this fixed order, each starting at a multiple of 64 bytes
(zero padding between):

  offset  size  field
  0       8     magic "LSPREDv\\0"
  8       4     u32 version (= FILE_VERSION)
  12      4     u32 header_size (= 256)
  16      4     u32 n_embd          input dimension
  20      4     u32 n_blocks        outputs (neuron blocks of the layer)
  24      4     u32 n_pca           p, PCA dimensions kept
  28      4     u32 n_hash_layers   L >= 1
  32      4     u32 tau             bits per hash code, 1..12
  36      4     u32 n_bits          d, width of the binary codes, multiple of 64
  40      4     u32 n_tables        M hash functions per layer
  44      4     i32 layer           FFN layer index this predictor serves (informational)
  48      8     u64 file_size
  56      4     u32 payload_crc32   CRC-32 (zlib) of bytes [256, file_size)
  60      4     u32 skip_weight     votes of the previous code in hashing layers >= 2 (version 1: 1)
  64..255       zero

  sections (shape, type):
  in_mean    [n_embd] f32            u = (x - in_mean) * in_scale
  in_scale   [n_embd] f32
  pca_q      [n_pca, n_embd] i8      z = (q_u . pca_q[r]) * s_u * pca_scale[r]
  pca_scale  [n_pca] f32
  hp1_q      [M*tau, n_pca] i8       a = (q_z . hp1_q[t]) * s_z * hp1_scale[t] + hp1_bias[t]
  hp1_scale  [M*tau] f32
  hp1_bias   [M*tau] f32
  table_1    [M, 2^tau, n_bits/64] u64   bit set = +1
  for k = 2..L:
    hp_k     [M*tau, n_bits/64] u64  binary hyperplanes
    thr_k    [M*tau] i32             code bit = (y . hp_k[t] >= thr_k[t])
    table_k  [M, 2^tau, n_bits/64] u64   y_k = sign(sum_m table_k[m][code_m] + skip_weight * y_{k-1})
  head_w     [n_blocks, n_bits/64] u64
  head_a     [n_blocks] f32          prio_b = (y . head_w[b]) * head_a[b] + head_c[b]
  head_c     [n_blocks] f32

Code bit j of hash function m is hyperplane t = m*tau + j; the bucket index is
sum_j bit_j << j. q_u, q_z are symmetric per-vector int8 quantisations (s = max|v| / 127,
round half to even, s = 1 for a zero vector).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

MAGIC = b"LSPREDv\0"
FILE_VERSION = 2
READS_VERSIONS = (1, 2)   # version 1 = version 2 with skip_weight 1
HEADER_SIZE = 256
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


# ---- numpy reference of the C evaluator ----------------------------------------------------

def _quantize_act(v: np.ndarray):
    """Symmetric per-vector int8 of rows v [N, D] f32: v ~ q * s, s = max|v| / 127 (1 if 0),
    q rounded half to even (rintf in C)."""
    m = np.abs(v).max(axis=1)
    s = np.where(m > 0, m / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(v / s[:, None]), -127, 127).astype(np.float32)
    return q, s


def unpack_signs(p: np.ndarray, n_bits: int) -> np.ndarray:
    """[R, n_bits/64] uint64 -> [R, n_bits] float64 in {-1, +1} (bit k of word k/64 set = +1)."""
    r = p.shape[0]
    b = np.unpackbits(np.ascontiguousarray(p).view(np.uint8).reshape(r, -1, 1), axis=-1)[:, :, ::-1]
    return np.where(b.reshape(r, n_bits) > 0, 1.0, -1.0)


def reference_eval(params: dict, x: np.ndarray, *, tau: int, n_tables: int) -> np.ndarray:
    """The C evaluator's result, computed with numpy: x [N, n_embd] f32 -> priorities
    [N, n_blocks] f32, bit for bit. Integer dot products are done in float64 (exact: every
    partial sum < 2^53); every float step is one float32 IEEE operation in the C order."""
    f32 = np.float32
    x = np.asarray(x, dtype=f32).reshape(-1, params["in_mean"].shape[0])
    u = (x - params["in_mean"]) * params["in_scale"]
    q, s = _quantize_act(u)
    dot = (q.astype(np.float64) @ params["pca_q"].astype(np.float64).T).astype(f32)
    z = (dot * s[:, None]) * params["pca_scale"]
    qz, sz = _quantize_act(z)
    dot = (qz.astype(np.float64) @ params["hp1_q"].astype(np.float64).T).astype(f32)
    a = ((dot * sz[:, None]) * params["hp1_scale"]) + params["hp1_bias"]
    n_bits = params["tables"][0].shape[1] * 64
    n = x.shape[0]
    shifts = np.arange(tau)
    y = None
    for k, tab in enumerate(params["tables"]):
        if k > 0:
            dotk = y @ unpack_signs(params["hp"][k - 1], n_bits).T
            a = dotk - params["thr"][k - 1].astype(np.float64)      # >= 0 <=> popdot >= thr
        idx = ((a >= 0).reshape(n, -1, tau).astype(np.int64) << shifts).sum(-1)   # [N, M] bucket
        t = unpack_signs(tab, n_bits).reshape(n_tables, 1 << tau, n_bits)
        acc = sum(t[m][idx[:, m]] for m in range(n_tables))
        if k > 0:
            acc = acc + params.get("skip_weight", 1) * y
        y = np.where(acc >= 0, 1.0, -1.0)
    dot = (y @ unpack_signs(params["head_w"], n_bits).T).astype(f32)
    return (dot * params["head_a"]) + params["head_c"]


# ---- the owner of the C evaluator ----------------------------------------------------------

class NativePredictor:
    """One loaded `blk.<il>.lspred`; `close()` (or `with`) frees the C handle."""

    def __init__(self, source):
        from ._native import check, ffi, lib

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
        from ._native import check

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
