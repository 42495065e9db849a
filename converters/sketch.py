"""The sketch stage: a low-bit copy of every layer's gate and up rows (leanstream mode's
exact-input scorer), written to ``sketch/blk.<il>.lssk`` in the block files' slot order.

No training: the rows are dequantized with gguf-py and re-quantized to the 2-bit LS2 rows
(leanstream_ggml/sketch.py), so a conversion is ready for sparse decode in the time it takes to
read the FFN once. Resumable per layer: a complete file
from an interrupted run is kept.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from leanstream_ggml import manifest as mf
from leanstream_ggml import sketch as skf
from leanstream_ggml.fileio import atomic_writer, fsync_dir

SKETCH_DIR = "sketch"
BLOCK_FREQ_NAME = "block_freq.npy"
DEFAULT_TYPE = "ls2"
TYPES = ("ls2",)          # what --sketch accepts ("none": no sketch)
WEIGHTS = ("one", "down_norm")
DEFAULT_WEIGHT = "one"    # ranking by |h| alone measured as good or better (docs/design.md §12)


def _dequantized_rows(t, n_rows: int) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(n_rows, -1).astype(np.float32, copy=False)


def _layer_sketch(layer, slots: np.ndarray, n_embd: int, n_ff: int, k: int, weight: str) -> bytes:
    pad = slots < 0
    idx = np.where(pad, 0, slots)
    parts = []
    for t in (layer.gate, layer.up):
        rows = _dequantized_rows(t, n_ff)[idx]         # f32 [n_rows, n_embd], slot order
        rows[pad] = 0.0
        parts.append(skf.quantize_rows(rows))
    if weight == "down_norm":
        down = _dequantized_rows(layer.down, n_embd)   # [n_embd, n_ff]
        w = np.linalg.norm(down, axis=0)[idx].astype(np.float32)
    else:
        w = np.ones(len(slots), dtype=np.float32)
    w[pad] = 0.0
    return skf.make_file(layer.il, n_embd, k, skf.LS2, parts[0], parts[1], w)


def _complete(path: Path, il: int, n_rows: int) -> bool:
    try:
        h, *_ = skf.read(path)
    except (OSError, ValueError):
        return False
    return h.il == il and h.n_rows == n_rows and h.type == skf.LS2


def write_sketches(source, out: Path, *, type_name: str = DEFAULT_TYPE, weight: str = DEFAULT_WEIGHT,
                   progress: bool = True, block_freq: np.ndarray | None = None) -> mf.SketchInfo:
    """Write one sketch file per layer (a complete one from an interrupted run is kept), and
    block_freq (f32 [n_layer, n_blocks], the order stage's calibration frequencies) if given."""
    from tqdm import tqdm

    if type_name not in TYPES:
        raise ValueError(f"sketch type must be one of {', '.join(TYPES)}, got {type_name!r}")
    if weight not in WEIGHTS:
        raise ValueError(f"sketch weight must be one of {', '.join(WEIGHTS)}, got {weight!r}")
    model = source.model
    if model.n_embd % 64:
        raise ValueError(f"the {type_name} sketch needs n_embd a multiple of 64, this model has {model.n_embd}; "
                         f"convert with --sketch none (dense mode) or with predictors")
    (out / SKETCH_DIR).mkdir(exist_ok=True)
    files, total = [], 0
    for layer in tqdm(model.layers, desc=f"writing {type_name} sketches", unit="layer", disable=not progress):
        rel = f"{SKETCH_DIR}/blk.{layer.il}.lssk"
        path = out / rel
        slots = source.slots(layer.il)
        if not _complete(path, layer.il, len(slots)):
            data = _layer_sketch(layer, slots, model.n_embd, model.n_ff, source.k, weight)
            with atomic_writer(path, durable=False) as f:
                f.write(data)
        files.append(rel)
        total += path.stat().st_size
    freq_rel = None
    if block_freq is not None:
        freq_rel = f"{SKETCH_DIR}/{BLOCK_FREQ_NAME}"
        with atomic_writer(out / freq_rel, durable=False) as f:
            np.save(f, np.ascontiguousarray(block_freq, dtype=np.float32), allow_pickle=False)
    fsync_dir(out / SKETCH_DIR)
    return mf.SketchInfo(files=files, type=type_name, weight=weight, bytes=total, block_freq=freq_rel)
