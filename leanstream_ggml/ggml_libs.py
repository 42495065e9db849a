"""llama.cpp's shared libraries in the installed llama-cpp-python (``llama_cpp/lib``), opened as
libllama loaded them.

The wheel holds ``libggml.so``, ``libggml.so.0`` and ``libggml.so.0.25.3`` as three copies of one
file, not links. libllama loads the soname file; opening another copy (as ``llama_cpp._ggml``
opens ``libggml.so``) loads a second instance, with its own backend registry. ``library`` opens
the soname file, which the dynamic loader finds already loaded.
"""

from __future__ import annotations

import ctypes
from pathlib import Path


def lib_dir() -> Path:
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


def library(soname: str) -> ctypes.CDLL:
    """``library("libggml-base.so.0")``: the instance libllama uses."""
    return ctypes.CDLL(str(lib_dir() / soname))
