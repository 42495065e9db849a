"""The read and write stages of the converter (the driver is ``stages.py``: ``leanstream_convert.convert``).

Reads the source with gguf-py (memory-mapped, read-only; the source is never modified) and writes

    OUT_DIR/base.gguf          every non-FFN tensor and every metadata key of the source, plus
                               leanstream.ffn_external = true (the patched llama.cpp then treats
                               ffn_gate/ffn_up/ffn_down as optional), leanstream.format_version,
                               leanstream.source_sha256
    OUT_DIR/ffn/blk.<il>.bin   per layer: neuron blocks (format: docs/formats.md; leanstream_convert/blockfile.py)

A mixture-of-experts source (any family of leanstream_ggml/model/moe_families.py) has no block
files: base.gguf leaves out its routed experts (ffn_{gate,up,down}_exps or ffn_gate_up_exps, with
their biases and scales) and keeps everything else (routers, shared experts, dense layers' FFNs);
each MoE layer's experts go to OUT_DIR/experts/blk.<il>.bin (leanstream_convert/moe_source.py).

Every file is written under a temporary name and renamed; a block file already complete from an
interrupted run is kept. The manifest (written last, by the driver) is built by ``make_manifest``
and written by ``save_manifest``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from leanstream_ggml.model import manifest as mf
from leanstream_ggml.model.checksum import crc32c_rows
from leanstream_ggml.model.formats import EXPERT_VERSION, MIN_ALIGN

from . import blockfile, ggml_rows, moe_source
from ._faults import kill_point
from .fileio import PARTIAL, atomic_write_text, atomic_writer, fsync_dir, sha256_file
from .validate import check_tensors

# gated FFN down(act(gate x) * up x), by architecture: the activation its llama.cpp graph uses
ACTIVATION_OF_ARCH = mf.ARCH_ACTIVATION   # the contract's table (leanstream_ggml/model/manifest.py)
# the dense ones (the mixture-of-experts families: leanstream_convert/moe_source.py)
SUPPORTED_ARCHS = tuple(ACTIVATION_OF_ARCH)
# architectures whose ffn_up holds the gate's rows and the up's in one tensor, ne = [n_embd, 2 n_ff],
# and that have no ffn_gate: llama.cpp's graph calls build_ffn with gate = NULL and LLM_FFN_SWIGLU,
# whose ggml_swiglu takes the activation of the first half of each output row times the second
# (ggml-cpu/ops.cpp, swiglu not swapped): rows 0 .. n_ff-1 are the gate, rows n_ff .. 2 n_ff-1 the
# up. The read stage describes each half as a tensor of its own (views of the same bytes), so
# every later stage reads a layer's gate and up as it reads any other model's.
FUSED_GATE_UP = ("phi3",)


class ConvertError(Exception):
    """A conversion cannot proceed; the message says why in terms a user can act on."""


def _gguf():
    # gguf is imported lazily so that importing converters (e.g. for the CLI registry) stays cheap
    try:
        import gguf
    except ImportError as e:  # pragma: no cover
        raise ConvertError("the converter needs gguf-py: pip install gguf") from e
    return gguf


def _type_problem(t) -> str | None:
    """Why an FFN tensor of gguf-py type t cannot be converted, or None: gate and up rows are kept
    as stored and dotted by ggml's CPU backend (its type traits: every type it runs, the library's
    own kernels where it has them); rows are dequantized by ggml (down's columns re-encoded, the
    sketch's rows)."""
    from leanstream_ggml.native import capi

    if not ggml_rows.dequantizes(t):
        return "ggml cannot dequantize it"
    if not capi.lib.ls_ggml_type_dots(int(t)):
        return "ggml's CPU backend has no dot product for its rows"
    return None


def ggml_type_name(t) -> str:
    """ggml's name of a gguf-py GGMLQuantizationType ("Q4_K" -> "q4_K", "F16" -> "f16")."""
    name = t.name.lower()
    if name.endswith("_k"):
        name = name[:-2] + "_K"
    return name


# ---- alignment -------------------------------------------------------------------------------

def device_align(path: str | os.PathLike) -> int:
    """Logical block size of the block device holding ``path`` (O_DIRECT's alignment unit).

    Reads /sys/dev/block/MAJ:MIN/queue/logical_block_size of the file system's device; a partition
    has no queue/ of its own, so its parent disk's is used. Falls back to 512 (virtual file
    systems, containers without /sys); never returns less than 512.
    """
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.stat(p)
    except OSError:
        return 512
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    candidates = [dev / "queue" / "logical_block_size"]
    try:
        candidates.append(dev.resolve().parent / "queue" / "logical_block_size")
    except OSError:
        pass
    for c in candidates:
        try:
            v = int(c.read_text().strip())
        except (OSError, ValueError):
            continue
        if v > 0 and v & (v - 1) == 0:
            return max(512, v)
    return 512


# ---- reading the source ------------------------------------------------------------------------

@dataclass
class _Layer:
    il: int
    gate: Any   # gguf ReaderTensor, ne = [n_embd, n_ff]
    up: Any     # ne = [n_embd, n_ff]
    down: Any   # ne = [n_ff, n_embd]


@dataclass
class _RowRange:
    """Rows first .. first + n_rows - 1 of a source tensor as a tensor of its own (a fused
    ffn_up's gate or up half): the fields of gguf-py's ReaderTensor that _describe reads."""
    name: str
    tensor_type: Any
    shape: list[int]      # ne = [row length, n_rows]
    n_bytes: int
    data_offset: int      # in the file
    data: np.ndarray      # the reader's view of the rows


def _row_range(t, first: int, n_rows: int, what: str) -> _RowRange:
    row_bytes = int(t.n_bytes) // int(t.shape[1])
    return _RowRange(f"{t.name} ({what} rows)", t.tensor_type, [int(t.shape[0]), n_rows], n_rows * row_bytes,
                     int(t.data_offset) + first * row_bytes, t.data[first:first + n_rows])


@dataclass
class _SourceMap:
    """The source mapped read-only (gguf-py's reader is opened in child processes only: in_child)."""
    data: np.memmap


@dataclass
class _SourceTensor:
    """A source FFN tensor as the write, order and sketch stages use it (the fields of gguf-py's
    ReaderTensor they read, its data shaped as gguf-py shapes it), a view of the map."""
    name: str
    tensor_type: Any
    shape: Any
    n_bytes: int
    data: np.ndarray


@dataclass
class _Model:
    reader: Any
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    layers: list[_Layer]
    ffn_names: set[str]           # what base.gguf leaves out (an MoE model's: its routed experts)
    path: Path | None = None
    moe: Any = None               # an MoE model's experts: moe_source.describe's data (read stage's
                                  # child), a moe_source.MoELayout (after); then ``layers`` is empty

    def release_pages(self) -> None:
        """Drop the source's mapped pages from this process (clean file pages: read again if needed),
        so that a layer done with is not held until the end of the conversion."""
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise"):
            import mmap

            try:
                mm.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):
                pass


def _open_gguf(src: Path):
    try:
        size = src.stat().st_size
    except FileNotFoundError:
        raise ConvertError(f"{src}: no such file") from None
    if not src.is_file():
        raise ConvertError(f"{src}: not a regular file")
    with open(src, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ConvertError(f"{src}: not a GGUF file (it starts with {magic!r}, a GGUF starts with b'GGUF')")
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(src, "r")   # read-only memory map
    except Exception as e:  # gguf-py raises ValueError, IndexError, KeyError, ... on bad input
        raise ConvertError(f"{src}: truncated or corrupt GGUF ({type(e).__name__}: {e})") from None
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ConvertError(f"{src}: truncated GGUF: tensor {t.name} ends at byte "
                               f"{t.data_offset + t.n_bytes}, the file has {size} bytes")
    problems = check_tensors(reader, size)     # what llama.cpp's loader checks (leanstream_convert/validate.py)
    if problems:
        raise ConvertError(f"{src}: corrupt GGUF (llama.cpp would refuse to load it): {problems[0]}"
                           + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))
    if reader.byte_order != "I":
        raise ConvertError(f"{src}: a GGUF of the other byte order is not supported")
    return reader


def _kv(reader, key: str, default=None):
    f = reader.get_field(key)
    if f is None or not f.types:
        return default
    try:
        return f.contents()
    except Exception:
        return default


def _inspect(reader, src: Path) -> _Model:
    arch = _kv(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ConvertError(f"{src}: no general.architecture key; is this a llama.cpp model GGUF?")
    tensors = {t.name: t for t in reader.tensors}
    moe = moe_source.is_moe(_kv(reader, f"{arch}.expert_count", 0), tensors)
    if moe and arch not in moe_source.SUPPORTED_ARCHS:
        raise ConvertError(f"{src}: a mixture-of-experts model ({arch}): {moe_source.refusal(arch)}")
    if not moe and arch in moe_source.MOE_ONLY_ARCHS:
        raise ConvertError(f"{src}: a {arch} model without experts (no {arch}.expert_count, no ffn_*_exps "
                           f"tensors): already converted, or not a complete model?")
    if arch not in SUPPORTED_ARCHS + moe_source.SUPPORTED_ARCHS:
        raise ConvertError(f"{src}: unsupported architecture {arch!r}; leanstream convert supports "
                           f"{', '.join(SUPPORTED_ARCHS)} (gated SiLU/GELU FFN); mixture-of-experts: "
                           f"{moe_source.SUPPORTED_TEXT}")
    n_layer = _kv(reader, f"{arch}.block_count")
    n_embd = _kv(reader, f"{arch}.embedding_length")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int) or n_layer <= 0 or n_embd <= 0:
        raise ConvertError(f"{src}: missing or invalid {arch}.block_count / {arch}.embedding_length")
    if moe:
        try:
            d = moe_source.describe(arch, lambda key: _kv(reader, key), tensors, n_layer, n_embd)
        except moe_source.MoEError as e:
            raise ConvertError(f"{src}: {e}") from None
        return _Model(reader, arch, n_layer, n_embd, d["n_ff_exp"], [], set(d["names"]), moe=d)
    fused = arch in FUSED_GATE_UP
    n_ff = None
    if fused:   # (the others' n_ff is their ffn_gate's)
        n_ff = _kv(reader, f"{arch}.feed_forward_length")
        if not isinstance(n_ff, int) or n_ff <= 0:
            raise ConvertError(f"{src}: missing or invalid {arch}.feed_forward_length")

    layers, ffn_names = [], set()
    for il in range(n_layer):
        names = {r: f"blk.{il}.ffn_{r}.weight" for r in (("up", "down") if fused else ("gate", "up", "down"))}
        got = {r: tensors.get(n) for r, n in names.items()}
        if not fused and got["gate"] is None and got["up"] is not None:
            raise ConvertError(f"{src}: layer {il} has no ffn_gate: a non-gated FFN ({arch}) is not supported "
                               f"(leanstream needs down(act(gate x) * up x))")
        missing = [names[r] for r in names if got[r] is None]
        if missing:
            raise ConvertError(f"{src}: missing FFN tensors {', '.join(missing)} (already converted, "
                               f"or not a complete model?)")
        extra = [n for n in tensors if n.startswith(f"blk.{il}.ffn_") and n not in names.values()
                 and not n.startswith(f"blk.{il}.ffn_norm.")]
        if extra:
            raise ConvertError(f"{src}: layer {il} has FFN tensors leanstream does not handle: {', '.join(extra)}")
        g, u, d = got.get("gate"), got["up"], got["down"]
        if fused:
            if [int(x) for x in u.shape] != [n_embd, 2 * n_ff]:
                raise ConvertError(f"{src}: {u.name} has shape {list(map(int, u.shape))}, expected "
                                   f"{[n_embd, 2 * n_ff]} ({arch} holds the gate's and the up's rows in one "
                                   f"tensor; n_ff={n_ff})")
            g, u = _row_range(u, 0, n_ff, "gate"), _row_range(u, n_ff, n_ff, "up")
        elif n_ff is None:
            n_ff = int(g.shape[1]) if len(g.shape) == 2 else -1
        for role, t, want in (("gate", g, [n_embd, n_ff]), ("up", u, [n_embd, n_ff]), ("down", d, [n_ff, n_embd])):
            if [int(x) for x in t.shape] != want:
                raise ConvertError(f"{src}: {t.name} has shape {list(map(int, t.shape))}, expected {want} "
                                   f"(n_embd={n_embd}; every layer must have the same n_ff={n_ff})")
            why = _type_problem(t.tensor_type)
            if why:
                raise ConvertError(f"{src}: {t.name} is {t.tensor_type.name}, which cannot be converted: {why}")
        layers.append(_Layer(il, g, u, d))
        ffn_names.update(names.values())
    return _Model(reader, arch, n_layer, n_embd, n_ff, layers, ffn_names)


# ---- one layer -----------------------------------------------------------------------------------

def _rows_as_bytes(t, n_rows: int) -> np.ndarray:
    """uint8 [n_rows, row_bytes]: the tensor's rows exactly as stored (memory-mapped, no copy)."""
    return t.data.view(np.uint8).reshape(n_rows, -1)


# the column formats a quantized ffn_down can be stored in (convert(down_type=...)); the K-quants
# need n_embd a multiple of 256 (a column of 1536 is six super-blocks). "auto" (the default):
# Q6_K where the source's ffn_down has at most Q6_K's 6.56 bits and n_embd allows it, else Q8_0
# (bench/results: under a memory limit Q6_K columns decode dense x1.3-1.4 faster for +0.5 %
# perplexity; with everything in RAM x0.8-0.9)
DOWN_TYPES = ("auto", "q8_0", "q6_k", "q5_k")
DEFAULT_DOWN_TYPE = "auto"


def resolve_down_type(want: str, down_types, n_embd: int) -> str:
    """The concrete column format "auto" stands for, given the source's ffn_down types."""
    if want != "auto":
        return want
    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    def bits(t):
        bs, ts = gguf.GGML_QUANT_SIZES[t]
        return 8.0 * ts / bs
    low = all(t not in (T.F32, T.F16, T.BF16) and bits(t) <= 6.5625 + 1e-9 for t in down_types)
    return "q6_k" if low and n_embd % 256 == 0 else "q8_0"


def down_columns(t, n_embd: int, n_ff: int, want: str = "q8_0"):
    """Transposed ffn_down: (uint8 [n_ff, col_bytes], ggml type of the columns).

    ffn_down has ne = [n_ff, n_embd] (n_embd rows of n_ff values); neuron i needs column i
    (n_embd values), which a row-quantized layout cannot give, so the matrix is dequantized with
    gguf-py and each column re-encoded:

    - quantized source, n_embd % 32 == 0 -> Q8_0. Re-quantizing a column of an already 4-bit
      matrix to 4 bits along the other axis would add a second quantization error of the same
      size as the first; Q8_0 (8.5 bits/weight, one f16 scale per 32 values) keeps the added error
      far below the source's own quantization noise while staying ~2x smaller than F16.
    - F16 source -> F16 (exact); F32 source -> F32 (exact); quantized with n_embd % 32 != 0 -> F16.
    - ``want`` "q6_k" / "q5_k" (a quantized source, n_embd % 256 == 0): fewer bytes per neuron
      (6.56 / 5.5 bits) for a larger second error, quantized by ggml (bench/results: the frontier).
    """
    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    src_type = t.tensor_type
    if src_type == T.F32:
        cols = np.ascontiguousarray(np.asarray(t.data, dtype=np.float32).reshape(n_embd, n_ff).T)
        return cols.view(np.uint8), T.F32
    if src_type == T.F16:
        cols = np.ascontiguousarray(np.asarray(t.data, dtype=np.float16).reshape(n_embd, n_ff).T)
        return cols.view(np.uint8), T.F16
    # Second quantization: see the docstring (Q8_0 error <= max|block| / 254 per 32 values)
    w = ggml_rows.dequantize(t, n_embd)                                   # f32 [n_embd, n_ff]
    cols = np.ascontiguousarray(w.T)                                      # f32 [n_ff, n_embd]
    del w
    qt = _down_type(src_type, n_embd, want)
    if qt in (T.Q6_K, T.Q5_K):
        return ggml_rows.quantize(cols, qt.name), qt
    if n_embd % 32 == 0:
        return gguf.quants.quantize(cols, T.Q8_0).reshape(n_ff, -1), T.Q8_0
    return cols.astype(np.float16).view(np.uint8), T.F16


def _down_type(src_type, n_embd: int, want: str = "q8_0"):
    T = _gguf().GGMLQuantizationType
    if src_type in (T.F32, T.F16):
        return src_type
    if want in ("q6_k", "q5_k") and n_embd % 256 == 0:
        return T[want.upper()]
    return T.Q8_0 if n_embd % 32 == 0 else T.F16


def _down_col_bytes(src_type, n_embd: int, want: str = "q8_0") -> int:
    gguf = _gguf()
    bs, ts = gguf.GGML_QUANT_SIZES[_down_type(src_type, n_embd, want)]
    return n_embd // bs * ts


def _layer_slots(order: np.ndarray, n_blocks: int, k: int) -> np.ndarray:
    """i32 [n_blocks*k]: neuron id per slot, -1 in the last block's empty slots."""
    slots = np.full(n_blocks * k, -1, dtype="<i4")
    slots[: len(order)] = order
    return slots


def pack_blocks(gate_rows: np.ndarray, up_rows: np.ndarray, down_cols: np.ndarray, slots: np.ndarray,
                h: blockfile.BlockHeader) -> np.ndarray:
    """uint8 [n_blocks, block_stride]: block b = [k gate rows][k up rows][k down cols][zeros]."""
    k, nb = h.k, h.n_blocks
    pad = slots < 0
    idx = np.where(pad, 0, slots)
    out = np.zeros((nb, h.block_stride), dtype=np.uint8)
    pos = 0
    for rows in (gate_rows, up_rows, down_cols):
        part = rows[idx]                      # [n_blocks*k, row_bytes] (copy)
        part[pad] = 0                         # padding slots hold zero bytes
        w = k * rows.shape[1]
        out[:, pos:pos + w] = part.reshape(nb, w)
        pos += w
    assert pos == h.block_payload
    return out


def _write_layer(path: Path, h: blockfile.BlockHeader, slots: np.ndarray, blocks: np.ndarray) -> None:
    h, meta = blockfile.pack_meta(h, slots, crc32c_rows(blocks))
    with atomic_writer(path, durable=False) as f:          # the folder is synced once, after all layers
        f.write(meta)                                         # header, perm and checksum tables
        f.write(memoryview(blocks).cast("B"))
        f.flush()
        os.fsync(f.fileno())
        if f.tell() != h.file_size:  # pragma: no cover - an internal error, not bad input
            raise ConvertError(f"{path}: wrote {f.tell()} bytes, expected {h.file_size}")


def _layer_done(path: Path, h: blockfile.BlockHeader, slots: np.ndarray) -> bool:
    """A block file from an earlier run that is complete and matches what would be written
    (its tables intact: the block checksums are verified whenever the blocks are read)."""
    try:
        if path.stat().st_size != h.file_size:
            return False
        old = blockfile.read_header(path)
        if dataclasses.replace(old, meta_crc=0) != h:
            return False
        with open(path, "rb") as f:
            meta = f.read(h.data_offset)
        return blockfile.check_meta(meta, old) and np.array_equal(blockfile.read_perm(path, h), slots)
    except (OSError, ValueError):
        return False


# ---- base.gguf -----------------------------------------------------------------------------------

def _field_value(field):
    """(value, GGUFValueType, sub_type) of a reader field, in the form GGUFWriter packs back
    byte-identically (strings as raw bytes: token pieces need not be valid UTF-8)."""
    gguf = _gguf()
    V = gguf.GGUFValueType
    vtype = field.types[0]
    if vtype == V.STRING:
        return bytes(field.parts[-1]), vtype, None
    if vtype == V.ARRAY:
        sub = V(int(field.parts[3][0]))   # [key len, key, value type, item type, count, items...]
        if sub == V.ARRAY:
            raise ConvertError(f"metadata key {field.name}: nested arrays are not supported")
        if sub == V.STRING:
            return [bytes(field.parts[i]) for i in field.data], vtype, sub
        if not field.data:
            return [], vtype, sub
        return np.concatenate([field.parts[i] for i in field.data]).tolist(), vtype, sub
    return field.parts[-1][0].item(), vtype, None


def _base_writer_class():
    gguf = _gguf()

    class BaseWriter(gguf.GGUFWriter):
        # GGUFWriter refuses empty arrays; a source may legitimately hold one: its bytes are the
        # array's type, its element type and a zero count, in the file's byte order
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == gguf.GGUFValueType.ARRAY and len(val) == 0 and sub_type is not None:
                order = "<" if self.endianess == gguf.GGUFEndian.LITTLE else ">"
                return (struct.pack(order + "I", vtype) if add_vtype else b"") + struct.pack(order + "IQ", sub_type, 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return BaseWriter


def write_base(model: _Model, path: Path, source_sha256: str) -> None:
    """base.gguf: the source minus the FFN tensors, every KV pair copied, leanstream.* keys added
    (gguf-py's reader and writer, in a child process: see in_child)."""
    in_child(_write_base, model.path, model.arch, sorted(model.ffn_names), path, source_sha256)


def _write_base(src: Path, arch: str, ffn_names: list[str], path: Path, source_sha256: str) -> None:
    reader = _open_gguf(src)
    ffn_names = set(ffn_names)
    tmp = path.with_name(path.name + PARTIAL)
    w = _base_writer_class()(tmp, arch)           # adds general.architecture first
    w.data_alignment = int(reader.alignment)      # general.alignment (if any) is copied below
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name.startswith("leanstream."):
            continue
        val, vtype, sub = _field_value(field)
        w.add_key_value(name, val, vtype, sub)
    w.add_bool("leanstream.ffn_external", True)
    w.add_uint32("leanstream.format_version", mf.FORMAT_VERSION)
    w.add_string("leanstream.source_sha256", source_sha256)
    for t in reader.tensors:
        if t.name not in ffn_names:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.flush()
        for f in w.fout or []:
            os.fsync(f.fileno())
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    w.close()
    os.replace(tmp, path)


def check_out_dir_apart(src: Path, out: Path) -> None:
    """The converter never writes over or next to its source: an output directory that
    contains it (at any depth) is refused, whatever --force says (--force deletes the
    converter's own files there, and base.gguf is one of them)."""
    try:
        src_real, out_real = src.resolve(), out.resolve()
    except (OSError, RuntimeError) as e:
        raise ConvertError(f"{out}: cannot resolve the path ({e})") from None
    if out_real == src_real or out_real in src_real.parents:
        raise ConvertError(f"{out}: contains the source {src}; choose an output directory that does not "
                           f"(the converter never writes next to its source, even with --force)")


def remove_partials(out: Path) -> None:
    """Files left half-written by a failed conversion (disk full, interrupted, ...)."""
    for d in (out, out / mf.FFN_DIR, out / mf.EXPERT_DIR):
        try:
            for p in d.glob("*" + PARTIAL):
                p.unlink(missing_ok=True)
        except OSError:
            pass


# ---- the read stage: the source and the block geometry ---------------------------------------

def _layer_orders(permutation, n_layer: int, n_ff: int) -> list[np.ndarray]:
    """One order of neuron ids per layer: identity, or the given permutation (one for all
    layers, a [n_layer, n_ff] array / list, or a mapping il -> order)."""
    if permutation is None:
        return [np.arange(n_ff, dtype=np.int32)] * n_layer
    if isinstance(permutation, Mapping):
        missing = [il for il in range(n_layer) if il not in permutation]
        if missing:
            raise ConvertError(f"permutation: no order for layers {missing}")
        orders = [np.asarray(permutation[il]) for il in range(n_layer)]
    else:
        arr = np.asarray(permutation)
        if arr.ndim == 1:
            orders = [arr] * n_layer
        elif arr.ndim == 2 and arr.shape[0] == n_layer:
            orders = list(arr)
        else:
            raise ConvertError(f"permutation: expected [n_ff] or [n_layer, n_ff], got shape {arr.shape}")
    out = []
    for il, o in enumerate(orders):
        if o.shape != (n_ff,) or not np.issubdtype(o.dtype, np.integer) or \
                not np.array_equal(np.sort(o), np.arange(n_ff)):
            raise ConvertError(f"permutation for layer {il} is not a permutation of 0..{n_ff - 1}")
        out.append(o.astype(np.int32))
    return out


@dataclass
class Source:
    """The read stage's result: an opened, checked source and what the write stage will do."""
    path: Path
    model: _Model
    sha256: str
    size: int
    k: int
    align: int
    orders: list[np.ndarray]    # per layer: neuron ids in on-disk order
    down_type: str = "q8_0"     # the column format of a quantized ffn_down (DOWN_TYPES, resolved: not "auto")

    @property
    def n_blocks(self) -> int:
        return -(-self.model.n_ff // self.k)

    def slots(self, il: int) -> np.ndarray:
        """i32 [n_blocks*k]: neuron id of each block slot of layer il, -1 = padding."""
        return _layer_slots(self.orders[il], self.n_blocks, self.k)

    def params(self) -> dict:
        """What the written files depend on (an interrupted conversion resumes only if equal)."""
        if self.model.moe is not None:
            return {"source_sha256": self.sha256, "source_size": self.size, "align": self.align,
                    "moe": {"expert_file_version": EXPERT_VERSION, "expert_order": moe_source.EXPERT_ORDER}}
        return {"source_sha256": self.sha256, "source_size": self.size, "k": self.k, "align": self.align,
                "permutation_sha256": hashlib.sha256(b"".join(o.tobytes() for o in self.orders)).hexdigest(),
                "block_file_version": blockfile.VERSION,
                **({"down_type": self.down_type} if self.down_type != "q8_0" else {})}


def in_child(fn, *args):
    """fn(*args) in a child process; its result (pickled) or its exception. gguf-py's reader holds
    every metadata array element as a numpy object (~3 KB per vocabulary entry: ~0.5 GB for
    Qwen2.5's 152k tokens), and a process gives little of that back once freed (~100 MB stayed):
    the reader lives only in children, so the converter's own process stays small for the stages
    that run the model within the memory limit. A fresh interpreter (spawn), not a fork: a forked
    copy of a process that holds native engines and their threads can crash collecting them."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def _describe(src: Path) -> dict:
    """The checked source as plain data (in_child): architecture, dimensions and, per layer, where
    each FFN tensor's bytes are and how gguf-py shapes them."""
    model = _inspect(_open_gguf(src), src)

    def spec(t):
        return {"name": t.name, "tensor_type": int(t.tensor_type), "shape": [int(x) for x in t.shape],
                "n_bytes": int(t.n_bytes), "data_offset": int(t.data_offset), "dtype": t.data.dtype.str,
                "data_shape": list(t.data.shape)}

    return {"arch": model.arch, "n_layer": model.n_layer, "n_embd": model.n_embd, "n_ff": model.n_ff,
            "ffn_names": sorted(model.ffn_names), "moe": model.moe,
            "layers": [[spec(t) for t in (layer.gate, layer.up, layer.down)] for layer in model.layers]}


def _model_of(src: Path, d: dict) -> _Model:
    T = _gguf().GGMLQuantizationType
    data = np.memmap(src, dtype=np.uint8, mode="r")

    def tensor(sp):
        raw = data[sp["data_offset"]:sp["data_offset"] + sp["n_bytes"]]
        return _SourceTensor(sp["name"], T(sp["tensor_type"]), sp["shape"], sp["n_bytes"],
                             raw.view(np.dtype(sp["dtype"])).reshape(sp["data_shape"]))

    layers = [_Layer(il, *(tensor(sp) for sp in specs)) for il, specs in enumerate(d["layers"])]
    moe = moe_source.MoELayout.from_dict(d["moe"]) if d.get("moe") else None
    return _Model(_SourceMap(data), d["arch"], d["n_layer"], d["n_embd"], d["n_ff"], layers, set(d["ffn_names"]), src,
                  moe)


def read_source(src: str | os.PathLike, out_dir: str | os.PathLike, *, k: int = 1, align: int | None = None,
                permutation=None, progress: bool = True, down_type: str = DEFAULT_DOWN_TYPE) -> Source:
    """Open and check the source GGUF, hash it, and fix the block geometry. Raises ConvertError."""
    if down_type not in DOWN_TYPES:
        raise ConvertError(f"down_type must be one of {', '.join(DOWN_TYPES)}, got {down_type!r}")

    src = Path(src)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1 or k > 1 << 16:
        raise ConvertError(f"k (neurons per block) must be a positive integer, got {k!r}")
    if align is None:
        align = device_align(out_dir)
    if not isinstance(align, int) or isinstance(align, bool) or align < MIN_ALIGN or align & (align - 1):
        raise ConvertError(f"align must be a power of two >= {MIN_ALIGN}, got {align!r}")
    model = _model_of(src, in_child(_describe, src))
    if model.moe is not None:
        if permutation is not None:
            raise ConvertError(f"{src.name} is a mixture-of-experts model ({model.arch}): a permutation orders a "
                               f"dense FFN's neurons; its experts are kept whole")
        sha = sha256_file(src, progress=progress, desc="hashing source")
        return Source(src, model, sha, src.stat().st_size, k, align, [])
    orders = _layer_orders(permutation, model.n_layer, model.n_ff)
    down_type = resolve_down_type(down_type, {layer.down.tensor_type for layer in model.layers}, model.n_embd)
    if down_type != "q8_0" and model.n_embd % 256:
        raise ConvertError(f"down_type {down_type} needs n_embd a multiple of 256 (K-quant super-blocks); "
                           f"{src.name} has n_embd {model.n_embd}: use q8_0")
    sha = sha256_file(src, progress=progress, desc="hashing source")
    return Source(src, model, sha, src.stat().st_size, k, align, orders, down_type)


# ---- the write stage: base.gguf and the block files ---------------------------------------------

def _layer_header(source: Source, layer) -> blockfile.BlockHeader:
    model = source.model
    gate_rows, up_rows = _rows_as_bytes(layer.gate, model.n_ff), _rows_as_bytes(layer.up, model.n_ff)
    return blockfile.make_header(
        il=layer.il, n_embd=model.n_embd, n_ff=model.n_ff, k=source.k, gate_type=int(layer.gate.tensor_type),
        up_type=int(layer.up.tensor_type), down_type=int(_down_type(layer.down.tensor_type, model.n_embd, source.down_type)),
        align=source.align, gate_row_bytes=gate_rows.shape[1], up_row_bytes=up_rows.shape[1],
        down_col_bytes=_down_col_bytes(layer.down.tensor_type, model.n_embd, source.down_type))


def _write_source_layer(source: Source, path: Path, layer, h: blockfile.BlockHeader, slots: np.ndarray) -> None:
    """One layer's block file from the source's tensors (one layer's rows and columns in RAM)."""
    model = source.model
    down_cols, down_type = down_columns(layer.down, model.n_embd, model.n_ff, source.down_type)  # uint8 [n_ff, col_bytes]
    assert int(down_type) == h.down_type and down_cols.shape[1] == h.down_col_bytes
    _write_layer(path, h, slots, pack_blocks(_rows_as_bytes(layer.gate, model.n_ff), _rows_as_bytes(layer.up, model.n_ff),
                                             down_cols, slots, h))
    model.release_pages()


def write_model(source: Source, out: Path, *, progress: bool = True, write: bool = True) -> tuple[list[mf.LayerEntry], mf.Totals, int]:
    """Write base.gguf and ffn/blk.<il>.bin in the source's slot order (a file already complete
    from an interrupted run is kept; ``write=False``: the files are there already, only their
    entries are made). Returns the manifest's layer entries, totals and the number of layers kept."""
    from tqdm import tqdm

    model = source.model
    n_ff = model.n_ff
    base = out / mf.BASE_NAME
    if write and not base.exists():
        write_base(model, base, source.sha256)
        model.release_pages()
    if model.moe is not None:   # no block files: an expert file per layer
        try:
            _, totals, kept = moe_source.write_experts(model.moe, model.reader.data, out, n_layer=model.n_layer,
                                                       n_embd=model.n_embd, align=source.align,
                                                       release=model.release_pages, progress=progress, write=write)
        except moe_source.MoEError as e:
            raise ConvertError(str(e)) from None
        return [], totals, kept
    (out / mf.FFN_DIR).mkdir(exist_ok=True)
    entries, kept = [], 0
    ffn_src = pad = region = on_disk = 0
    for layer in tqdm(model.layers, desc="writing FFN block files", unit="layer", disable=not progress or not write):
        il = layer.il
        h = _layer_header(source, layer)
        rel = mf.BLOCK_FILE.format(il=il)
        if write:
            slots = source.slots(il)
            if _layer_done(out / rel, h, slots):
                kept += 1
            else:
                _write_source_layer(source, out / rel, layer, h, slots)
                kill_point("write-layer")
        entries.append(mf.LayerEntry(
            il=il, file=rel, gate_type=ggml_type_name(layer.gate.tensor_type),
            up_type=ggml_type_name(layer.up.tensor_type), down_type=ggml_type_name(_gguf().GGMLQuantizationType(h.down_type)),
            n_blocks=h.n_blocks, block_stride=h.block_stride, block_payload=h.block_payload,
            data_offset=h.data_offset, file_size=h.file_size))
        ffn_src += layer.gate.n_bytes + layer.up.n_bytes + layer.down.n_bytes
        region += h.n_blocks * h.block_stride
        pad += h.n_blocks * h.block_stride - n_ff * (h.gate_row_bytes + h.up_row_bytes + h.down_col_bytes)
        on_disk += h.file_size
    if write:
        fsync_dir(out / mf.FFN_DIR)              # the renames above are durable before the manifest
    totals = mf.Totals(ffn_bytes_source=ffn_src, ffn_bytes_on_disk=on_disk, padding_bytes=pad,
                       padding_waste=pad / region)
    return entries, totals, kept


def reorder_layers(source: Source, out: Path, *, progress: bool = True) -> int:
    """The reorder stage: each layer's block file rewritten with its neurons in ``source.orders``
    (one neuron per block), from the file the write stage wrote in source order: one layer's
    blocks in RAM, written under a temporary name and renamed. A file already in that order is
    kept; one in neither order (damaged) is written again from the source. Returns how many were
    rewritten."""
    from tqdm import tqdm

    done = 0
    for layer in tqdm(source.model.layers, desc="reordering block files", unit="layer", disable=not progress):
        path = out / mf.BLOCK_FILE.format(il=layer.il)
        h = _layer_header(source, layer)
        slots = source.slots(layer.il)
        if _layer_done(path, h, slots):
            continue
        identity = np.arange(h.n_blocks * h.k, dtype="<i4")
        if source.k == 1 and _layer_done(path, h, identity):
            blocks = np.fromfile(path, np.uint8, count=h.n_blocks * h.block_stride, offset=h.data_offset)
            blocks = blocks.reshape(h.n_blocks, h.block_stride)[slots]   # new slot s holds neuron slots[s]
            _write_layer(path, h, slots, blocks)
            del blocks
        else:
            _write_source_layer(source, path, layer, h, slots)
        done += 1
        kill_point("reorder-layer")
    fsync_dir(out / mf.FFN_DIR)
    return done


def estimate_output_bytes(source: Source, sketch: str) -> int:
    """Bytes a conversion writes: base.gguf, the block files (and one layer's rewrite at a time),
    the sketch."""
    model = source.model
    if model.moe is not None:
        return (source.size - model.moe.source_bytes()
                + moe_source.output_bytes(model.moe, model.n_layer, model.n_embd, source.align))
    ffn = sum(layer.gate.n_bytes + layer.up.n_bytes + layer.down.n_bytes for layer in model.layers)
    files = [_layer_header(source, layer).file_size for layer in model.layers]
    sketch_bytes = 0
    if sketch != "none":
        from .sketch import row_bytes

        sketch_bytes = model.n_layer * (2 * model.n_ff * row_bytes(model.n_embd) + 4 * model.n_ff + 4096)
    return source.size - ffn + sum(files) + max(files) + sketch_bytes


# what the write stage holds besides the process: one layer's down matrix as f32 twice (dequantized
# and transposed), its columns re-quantized, and its packed blocks
def layer_working_bytes(source: Source) -> int:
    model = source.model
    if model.moe is not None:
        return moe_source.working_bytes(model.moe, model.n_embd, source.align)
    h = _layer_header(source, model.layers[0])
    return 2 * 4 * model.n_embd * model.n_ff + model.n_ff * h.down_col_bytes + h.n_blocks * h.block_stride


def check_fits(source: Source, out: Path, limit: int, *, sketch: str) -> None:
    """Before anything is written: a clear error when the disk cannot hold the output, or the
    memory limit cannot hold one layer's work beside this process."""
    from leanstream_ggml.memplan import process_bytes

    from .budget import MiB, free_disk

    need = estimate_output_bytes(source, sketch)
    free = free_disk(out)
    # a resumed conversion has written part of it already
    have = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.is_dir() else 0
    if need - have > free:
        raise ConvertError(f"{out}: not enough disk space: the conversion writes about {need / 1e6:.0f} MB "
                           f"({have / 1e6:.0f} MB of it there already), the file system has {free / 1e6:.0f} MB free")
    work, now = layer_working_bytes(source), process_bytes()
    m = source.model
    shape = (f"n_ff {m.n_ff} x n_embd {m.n_embd}" if m.moe is None else
             f"{m.moe.n_expert} experts of n_ff_exp {m.n_ff} x n_embd {m.n_embd}")
    if now + work > limit:
        raise ConvertError(f"memory limit {limit / 1e6:.0f} MB is too small to convert {source.path.name}: one layer's "
                           f"work takes {work / MiB:.0f} MiB ({shape}) "
                           f"besides the {now / MiB:.0f} MiB this process holds; at least "
                           f"{(now + work) / 1e6:.0f} MB is needed")


def make_manifest(source: Source, out: Path, entries: list[mf.LayerEntry], totals: mf.Totals,
                  predictor: mf.PredictorInfo | None) -> mf.Manifest:
    model = source.model
    moe = None if model.moe is None else moe_source.moe_info(model.moe, model.n_layer, model.n_embd, source.align)
    return mf.Manifest(
        source=mf.SourceInfo(filename=source.path.name, sha256=source.sha256, size=source.size,
                             path=str(source.path.resolve())),
        architecture=model.arch, n_layer=model.n_layer, n_embd=model.n_embd, n_ff=model.n_ff,   # (MoE: n_ff_exp)
        activation=ACTIVATION_OF_ARCH[model.arch] if model.moe is None else model.moe.activation, block=mf.BlockGeometry(k=source.k, align=source.align),
        layers=entries,
        totals=totals, base=mf.BaseInfo(file=mf.BASE_NAME, size=(out / mf.BASE_NAME).stat().st_size),
        predictor=predictor, moe=moe)


def save_manifest(manifest: mf.Manifest, model_dir: str | os.PathLike) -> Path:
    """Write ``manifest.json`` atomically (temporary name, fsync, rename), after recording the
    checksums of the files it names (base.gguf, sketch and predictor files) as they are now."""
    manifest.validate()
    manifest.record_checksums(model_dir)
    path = Path(model_dir) / mf.MANIFEST_NAME
    atomic_write_text(path, manifest.to_json())
    return path

