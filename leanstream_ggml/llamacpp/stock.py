"""In RAM, the source GGUF on llama.cpp's own kernels (``in_ram="auto"``, the default).

Where the whole model fits (no memory limit or budget given, and the machine's allows it all)
every FFN weight stays resident and nothing streams: the op then only adds its own arithmetic,
and where llama.cpp repacks the FFN weights for this CPU (its CPU_REPACK buffer: Q4_0, Q4_K and
IQ4_NL rows interleaved for AVX2 and ARM's dot products) its kernels read them faster than the op
reads neuron blocks (docs/design.md §23; bench/results). There ``Llama`` loads the GGUF the model directory
was converted from and runs it as ``llama_cpp.Llama`` would with the same arguments: the same
answers, no speculation (a batch of repacked rows does not round as each token alone, so a draft
could change an answer). Where llama.cpp does not repack them (SmolLM2's Q4_1), the op is the
faster and stays.

The source is ``source=``, else the file the manifest names: where it was converted from
(``source.path``), beside the model directory, or in the model cache (where ``leanstream convert``
of a registry model found it);
it must have the manifest's size and sha256 (hashed once per file version, remembered in the
cache's ``verified-sources.json``). Without it the op runs, and ``stock_reason`` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from ctypes import c_void_p
from pathlib import Path

from leanstream_ggml.llamacpp import ggml_ctypes
from leanstream_ggml.native import modes

GGML_TYPE_F32 = 0
GGML_BACKEND_DEVICE_TYPE_CPU = 0
VERIFIED = "verified-sources.json"


def repacks(ggml_type: int, n_in: int, n_out: int) -> bool:
    """Whether llama.cpp's CPU backend, as loaded in this process, keeps a weight of this type and
    shape [n_in, n_out] in its CPU_REPACK buffer: what llama_model_load asks (a matrix product of
    the weight placed in that buffer type, supported by the CPU device), asked the same way."""
    from leanstream_ggml.native import _native  # noqa: F401  (loads ggml's backends, as the first Llama would)

    b, g = ggml_ctypes.base(), ggml_ctypes.ggml()
    dev = g.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        return False
    fn = b.ggml_backend_reg_get_proc_address(b.ggml_backend_dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return False
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(c_void_p), c_void_p)(fn)(dev)
    repack, i = None, 0
    while bufts and bufts[i]:
        if b.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
            repack = bufts[i]
        i += 1
    if repack is None:
        return False
    ctx = b.ggml_init(ggml_ctypes.InitParams(1 << 16, None, True))
    if not ctx:
        return False
    buf = None
    try:
        w = b.ggml_new_tensor_2d(ctx, ggml_type, n_in, n_out)
        op = b.ggml_mul_mat(ctx, w, b.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_in, 1))
        buf = b.ggml_backend_buft_alloc_buffer(repack, 0)   # a buffer of that type, as llama.cpp makes one
        # struct ggml_tensor { enum ggml_type type; struct ggml_backend_buffer * buffer; ... }
        c_void_p.from_address(w + ctypes.sizeof(c_void_p)).value = buf
        return bool(b.ggml_backend_dev_supports_op(dev, op))
    finally:
        if buf:
            b.ggml_backend_buffer_free(buf)
        b.ggml_free(ctx)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _verified(path: Path, sha256: str) -> bool:
    """The file's sha256 is ``sha256``: hashed once per version of the file (path, inode, size,
    mtime), remembered in the cache directory."""
    from leanstream_ggml.build import cache_dir

    st = path.stat()
    key, version = str(path.resolve()), [st.st_ino, st.st_size, st.st_mtime_ns]
    record = cache_dir() / VERIFIED
    try:
        seen = json.loads(record.read_text())
    except (OSError, ValueError):
        seen = {}
    if not isinstance(seen, dict):
        seen = {}
    got = seen.get(key)
    if isinstance(got, dict) and got.get("version") == version and isinstance(got.get("sha256"), str):
        return got["sha256"] == sha256
    digest = _sha256(path)
    seen[key] = {"version": version, "sha256": digest}
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(seen, indent=1))
        os.replace(tmp, record)
    except OSError:
        pass   # a read-only cache: hashed again next time
    return digest == sha256


def find_source(model_dir: Path, manifest, given: str | None = None) -> tuple[Path | None, str]:
    """(the source GGUF, "") or (None, why not): ``given``, else the first of the manifest's file as
    converted (its path), beside the model directory or in the model cache that holds the
    manifest's size and sha256."""
    from leanstream_ggml.model.registry import models_dir

    src = manifest.source
    if given is not None:
        candidates = [Path(given)]
    else:
        candidates = [Path(src.path)] if src.path else []
        candidates += [model_dir.resolve().parent / src.filename, models_dir() / src.filename]
        candidates = list(dict.fromkeys(candidates))
    why = None
    for p in candidates:
        if not p.is_file():
            continue
        if p.stat().st_size != src.size:
            why = why or f"{p} is not the file {model_dir} was converted from (size {p.stat().st_size}, not {src.size})"
        elif not _verified(p, src.sha256):
            why = why or f"{p} is not the file {model_dir} was converted from (its sha256 differs)"
        else:
            return p, ""
    if why:
        return None, why
    where = " or ".join(str(p.parent) for p in candidates)
    return None, f"the source GGUF {src.filename} is not in {where}"


def choose(model_dir: Path, manifest, o: dict, given: dict) -> tuple[Path | None, str]:
    """(the source GGUF to run on llama.cpp's kernels, "") or (None, why the op runs)."""
    if o["in_ram"] != "auto":
        return None, "in_ram='stream'"
    if o["memory_limit"] or o["memory_budget"] is not None:
        return None, "a memory limit or budget: the FFN streams"
    if modes.is_sparse(o["mode"]):
        return None, f"mode={o['mode']!r} decodes sparse"
    if given.get("speculative") not in (None, "auto", "off"):
        return None, f"speculative={given['speculative']!r} asks for the op's drafts"
    if manifest.moe is not None:   # llama.cpp's own mul_mat_id over every expert, as stock runs it
        return find_source(model_dir, manifest, o["source"])
    from leanstream_ggml.model.manifest import GGML_TYPE_IDS

    gate = manifest.layers[0].gate_type
    if gate not in GGML_TYPE_IDS or not repacks(GGML_TYPE_IDS[gate], manifest.n_embd, manifest.n_ff):
        return None, f"llama.cpp does not repack {gate} weights on this CPU: the op is the faster"
    return find_source(model_dir, manifest, o["source"])
