"""Writing predictor files (the format, its reader and the numpy reference of its inference are
in ``leanstream_ggml/predictor.py``, the runtime's side of the contract)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from leanstream_ggml.fileio import atomic_write_bytes
from leanstream_ggml.predictor import ALIGN, FILE_VERSION, HDR, HEADER_SIZE, MAGIC, crc32, layout


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
