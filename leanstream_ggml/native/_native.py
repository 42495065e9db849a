"""1:1 cffi (ABI mode) binding of native/include/leanstream.h.

The header is the interface: its declarations between LS_CDEF_BEGIN and LS_CDEF_END are handed
to ``ffi.cdef`` as they are. Every status code is checked here and turned into
:class:`LeanstreamError`. The ABI version compiled into the library must equal the header's.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import cffi

_PKG = Path(__file__).resolve().parents[1]   # leanstream_ggml/
# the library and the header it was compiled from lie side by side in _lib/ (a wheel's, or a source
# tree's built by `python -m leanstream_ggml.build`); a source tree's own header is the fallback
_LIB = _PKG / "_lib" / "libleanstream.so"
_HEADER_CANDIDATES = [
    _PKG / "_lib" / "leanstream.h",
    _PKG.parent / "native" / "include" / "leanstream.h",
]
_BUILD_IT = ("pip install leanstream-ggml again (its wheel carries it), or in a source tree "
             "`python -m leanstream_ggml.build`")


class LeanstreamError(RuntimeError):
    """An error reported by libleanstream (I/O, malformed block file, budget, ...)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _header_text() -> str:
    for h in _HEADER_CANDIDATES:
        if h.exists():
            return h.read_text()
    raise ImportError(f"{_HEADER_CANDIDATES[0]} not found: {_BUILD_IT}")


def _cdef_source(text: str) -> str:
    body = text.split("\n// LS_CDEF_BEGIN\n", 1)[1].split("\n// LS_CDEF_END\n", 1)[0]
    body = re.sub(r"\bLS_API\s+", "", body)
    return body


def cpu_variants() -> list[str]:
    """The CPU backend variants this llama.cpp build has (``libggml-cpu-<variant>.so``)."""
    from leanstream_ggml.llamacpp.ggml_ctypes import lib_dir

    return sorted(p.name[len("libggml-cpu-"):-len(".so")] for p in lib_dir().glob("libggml-cpu-*.so"))


def _force_cpu_variant(name: str) -> None:
    """LEANSTREAM_GGML_CPU=<variant>: load that CPU module instead of the one libggml would pick
    (to compare variants, or to step around one that misbehaves on a CPU). It must run before
    anything loads a backend (llama_backend_init, the first Llama)."""
    if not name:
        return
    from leanstream_ggml.llamacpp import ggml_ctypes

    path = ggml_ctypes.lib_dir() / f"libggml-cpu-{name}.so"
    if not path.exists():
        raise ImportError(f"LEANSTREAM_GGML_CPU={name}: this llama.cpp build has no such CPU variant "
                          f"(it has: {', '.join(cpu_variants()) or 'none'})")
    g = ggml_ctypes.ggml()   # the registry libllama uses
    if g.ggml_backend_reg_count() != 0:
        raise ImportError(f"LEANSTREAM_GGML_CPU={name}: a ggml backend is already loaded in this process")
    if not g.ggml_backend_load(str(path).encode()):
        raise ImportError(f"LEANSTREAM_GGML_CPU={name}: ggml could not load {path} "
                          "(does this CPU have its instruction set?)")


def _load_backends(variant: str) -> None:
    """Load ggml's backends now (what the first Llama would do): the CPU variant given or the one
    libggml ranks best. llama-cpp-python prints ggml's log until a Llama sets its verbosity, so
    this runs with its logger at ERROR unless someone set it."""
    import logging

    import llama_cpp
    from llama_cpp import _logger
    level = _logger.logger.level
    if level == logging.NOTSET:
        _logger.logger.setLevel(logging.ERROR)
    try:
        _force_cpu_variant(variant)
        llama_cpp.llama_backend_init()
    finally:
        _logger.logger.setLevel(level)


def _load():
    text = _header_text()
    ffi = cffi.FFI()
    ffi.cdef(_cdef_source(text))
    # libllama/ggml must be loaded first so libleanstream binds to the same ggml instance
    import llama_cpp

    from leanstream_ggml.build import LLAMA_CPP_PYTHON_VERSION
    from leanstream_ggml.llamacpp._llama_cpp import has_ffn_builder

    if not has_ffn_builder():
        raise ImportError(f"the llama-cpp-python in {Path(llama_cpp.__file__).parent} is not the patched build "
                          "leanstream needs (its libllama has no llama_set_ffn_builder): install the patched one "
                          "with `python -m leanstream_ggml.build` (it builds llama-cpp-python "
                          f"{LLAMA_CPP_PYTHON_VERSION} with leanstream's patches once, ~8 minutes on 2 cores, cached)")
    if not _LIB.exists():
        raise ImportError(f"{_LIB} is missing: {_BUILD_IT}")
    _load_backends(os.environ.get("LEANSTREAM_GGML_CPU", ""))

    lib = ffi.dlopen(str(_LIB))
    want = int(re.search(r"#define LS_ABI_VERSION (\d+)", text).group(1))
    have = lib.ls_abi_version()
    if have != want:
        raise ImportError(f"libleanstream ABI version {have} != header version {want}: rebuild with "
                          "`python -m leanstream_ggml.build`")
    return ffi, lib


ffi, lib = _load()


def errmsg() -> str:
    return ffi.string(lib.ls_errmsg()).decode(errors="replace")


def check(status: int, what: str = "") -> None:
    """Raise LeanstreamError for a failed ls_* call (message from ls_errmsg)."""
    if status != lib.LS_OK:
        msg = errmsg()
        raise LeanstreamError(status, f"{what}: {msg}" if what else msg)


# ---- the mode table, as the engine defines it (native/src/mode.c) -------------------------------

MODES: tuple[str, ...] = tuple(ffi.string(lib.ls_mode_name(i)).decode() for i in range(lib.LS_N_MODES))
_USES = {"sketch": lib.LS_USES_SKETCH, "predictors": lib.LS_USES_PREDICTORS, "rank": lib.LS_USES_RANK,
         "needs_rank": lib.LS_NEEDS_RANK, "sparse": lib.LS_DECODES_SPARSE}


def mode_id(mode: str) -> int:
    """The LS_MODE_* of a mode's name (ValueError for an unknown one)."""
    try:
        return MODES.index(mode)
    except ValueError:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}") from None


def mode_uses(mode: str) -> frozenset[str]:
    """What a mode reads from a model directory and does: a subset of {"sketch", "predictors",
    "rank", "needs_rank", "sparse"} (ls_mode_uses; dense: nothing). "sparse": its decode computes
    a selection of each layer's blocks."""
    bits = lib.ls_mode_uses(mode_id(mode))
    return frozenset(name for name, bit in _USES.items() if bits & bit)


_PARAMS_NUMERIC = [name for name, f in ffi.typeof("ls_engine_params").fields if f.type.kind == "primitive"]


def mode_defaults(mode: str, predictors: bool = False) -> dict:
    """The engine's numeric parameters of a mode the user set nothing for, as an engine would run
    with them (ls_engine_params_resolve): sparsity, hot_fraction (with or without predictors),
    candidate_ratio, n_io_threads, ... A help shows these instead of writing them again."""
    p = ffi.new("ls_engine_params *")
    lib.ls_engine_params_init(p)
    p.mode = mode_id(mode)
    paths = ffi.new("const char *[1]")   # (resolving reads only whether predictors are given)
    if predictors:
        p.predictor_paths = paths
    check(lib.ls_engine_params_resolve(p), "ls_engine_params_resolve")
    return {name: getattr(p, name) for name in _PARAMS_NUMERIC}
