"""Predictor file format (version 2): one file per FFN layer, `predictor/blk.<il>.lspred`.

No torch here: the runtime and the tests read these files with numpy (and native/ with C).
Little-endian. A 256-byte header, then sections in this fixed order, each starting at a
multiple of 64 bytes (zero padding between):

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

import os
import struct
import zlib
from pathlib import Path

import numpy as np

MAGIC = b"LSPREDv\0"
FILE_VERSION = 2
READS_VERSIONS = (1, 2)   # version 1 = version 2 with skip_weight 1
HEADER_SIZE = 256
ALIGN = 64
_HDR = struct.Struct("<8sIIIIIIIIIiQII")


class PredictorFormatError(ValueError):
    """A predictor file is malformed, truncated or of another version."""


def crc32(data) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def _layout(n_embd, n_blocks, n_pca, L, tau, n_bits, M):
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


def _flat(params: dict) -> dict:
    out = {k: params[k] for k in ("in_mean", "in_scale", "pca_q", "pca_scale", "hp1_q", "hp1_scale",
                                  "hp1_bias", "head_w", "head_a", "head_c")}
    for k, t in enumerate(params["tables"], start=1):
        out[f"table_{k}"] = t
    for k, (hp, thr) in enumerate(zip(params["hp"], params["thr"]), start=2):
        out[f"hp_{k}"], out[f"thr_{k}"] = hp, thr
    return out


def _nest(flat: dict, L: int) -> dict:
    p = {k: v for k, v in flat.items() if not k.startswith(("table_", "hp_", "thr_"))}
    p["tables"] = [flat[f"table_{k}"] for k in range(1, L + 1)]
    p["hp"] = [flat[f"hp_{k}"] for k in range(2, L + 1)]
    p["thr"] = [flat[f"thr_{k}"] for k in range(2, L + 1)]
    return p


def serialize(params: dict, *, tau: int, n_tables: int, layer: int = -1) -> bytes:
    n_pca, n_embd = params["pca_q"].shape
    n_blocks, w = params["head_w"].shape
    L = len(params["tables"])
    flat = _flat(params)
    body = bytearray()
    for name, dt, shape in _layout(n_embd, n_blocks, n_pca, L, tau, w * 64, n_tables):
        a = np.ascontiguousarray(flat[name], dtype=dt)
        if a.shape != shape:
            raise ValueError(f"{name}: shape {a.shape}, expected {shape}")
        body += a.tobytes()
        body += b"\0" * (-len(body) % ALIGN)
    size = HEADER_SIZE + len(body)
    hdr = _HDR.pack(MAGIC, FILE_VERSION, HEADER_SIZE, n_embd, n_blocks, n_pca, L, tau, w * 64,
                    n_tables, layer, size, crc32(body), int(params.get("skip_weight", 1)))
    return hdr + b"\0" * (HEADER_SIZE - len(hdr)) + bytes(body)


def write_predictor(path, params: dict, *, tau: int, n_tables: int, layer: int = -1) -> int:
    """Write atomically (temporary name, then rename). Returns the file size in bytes."""
    data = serialize(params, tau=tau, n_tables=n_tables, layer=layer)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(data)


def parse(data: bytes, *, check_payload: bool = True) -> tuple[dict, dict]:
    """bytes of a predictor file -> (header dict, nested params). Treats the input as hostile."""
    if len(data) < HEADER_SIZE:
        raise PredictorFormatError(f"predictor file truncated: {len(data)} bytes, header needs {HEADER_SIZE}")
    (magic, version, hsize, n_embd, n_blocks, n_pca, L, tau, n_bits, M, layer, size,
     crc, skip) = _HDR.unpack_from(data)
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
    layout = _layout(n_embd, n_blocks, n_pca, L, tau, n_bits, M)
    off = HEADER_SIZE
    flat = {}
    for name, dt, shape in layout:
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
