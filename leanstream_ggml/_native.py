"""1:1 cffi (ABI mode) binding of native/include/leanstream.h.

The header is the interface: its declarations between LS_CDEF_BEGIN and LS_CDEF_END are handed
to ``ffi.cdef`` as they are. Every status code is checked here and turned into
:class:`LeanstreamError`. The ABI version compiled into the library must equal the header's.
"""

from __future__ import annotations

import re
from pathlib import Path

import cffi

_PKG = Path(__file__).resolve().parent
_HEADER_CANDIDATES = [
    _PKG.parent / "native" / "include" / "leanstream.h",   # source checkout / editable install
    _PKG / "_lib" / "leanstream.h",                           # installed copy
]
_LIB = _PKG / "_lib" / "libleanstream.so"


class LeanstreamError(RuntimeError):
    """An error reported by libleanstream (I/O, malformed block file, budget, ...)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _header_text() -> str:
    for h in _HEADER_CANDIDATES:
        if h.exists():
            return h.read_text()
    raise ImportError("leanstream.h not found; run `python -m leanstream_ggml.build`")


def _cdef_source(text: str) -> str:
    body = text.split("\n// LS_CDEF_BEGIN\n", 1)[1].split("\n// LS_CDEF_END\n", 1)[0]
    body = re.sub(r"\bLS_API\s+", "", body)
    return body


def _load():
    text = _header_text()
    ffi = cffi.FFI()
    ffi.cdef(_cdef_source(text))
    if not _LIB.exists():
        raise ImportError(f"{_LIB} is missing: build it with `python -m leanstream_ggml.build`")
    # libllama/ggml must be loaded first so libleanstream binds to the same ggml instance
    import llama_cpp  # noqa: F401

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
         "needs_rank": lib.LS_NEEDS_RANK}


def mode_id(mode: str) -> int:
    """The LS_MODE_* of a mode's name (ValueError for an unknown one)."""
    try:
        return MODES.index(mode)
    except ValueError:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}") from None


def mode_uses(mode: str) -> frozenset[str]:
    """What a mode reads from a model directory: a subset of {"sketch", "predictors", "rank",
    "needs_rank"} (ls_mode_uses; dense: nothing)."""
    bits = lib.ls_mode_uses(mode_id(mode))
    return frozenset(name for name, bit in _USES.items() if bits & bit)
