"""ggml's C API through ctypes: the libggml instance libllama loaded, every function this project
calls declared once (``SIGNATURES``).

    from leanstream_ggml.llamacpp import ggml_ctypes
    g = ggml_ctypes.base()                      # libggml-base: the gguf reader, the quantizer
    ctx = g.gguf_init_from_file(b"base.gguf", ggml_ctypes.GGUFInitParams(True, None))

The wheel holds ``libggml.so``, ``libggml.so.0`` and ``libggml.so.0.25.3`` as three copies of one
file, not links. libllama loads the soname file; opening another copy (as ``llama_cpp._ggml``
opens ``libggml.so``) loads a second instance, with its own backend registry. ``base`` and
``ggml`` open the soname files, which the dynamic loader finds already loaded.

(libleanstream is bound with cffi from its header, _native.py; libllama through llama-cpp-python's
own ctypes bindings, _llama_cpp.py.)
"""

from __future__ import annotations

import ctypes
import functools
from ctypes import c_bool, c_char_p, c_int, c_int64, c_size_t, c_uint32, c_void_p
from pathlib import Path

BASE, GGML = "libggml-base.so.0", "libggml.so.0"


class GGUFInitParams(ctypes.Structure):
    """struct gguf_init_params (gguf.h)."""
    _fields_ = [("no_alloc", c_bool), ("ctx", c_void_p)]


class InitParams(ctypes.Structure):
    """struct ggml_init_params (ggml.h)."""
    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


class TypeTraits(ctypes.Structure):
    """struct ggml_type_traits (ggml.h): a type's block geometry and its (de)quantizers."""
    _fields_ = [("type_name", c_char_p), ("blck_size", c_int64), ("blck_size_interleave", c_int64),
                ("type_size", c_size_t), ("is_quantized", c_bool), ("to_float", c_void_p),
                ("from_float_ref", c_void_p)]


# enum gguf_type values (gguf.h) the header reader handles
GGUF_TYPE_UINT32, GGUF_TYPE_INT32, GGUF_TYPE_STRING, GGUF_TYPE_ARRAY = 4, 5, 8, 9

# library -> function -> (argtypes, restype)
SIGNATURES = {
    BASE: {
        # gguf.h: the reader of base.gguf's header (memplan.read_base)
        "gguf_init_from_file": ([c_char_p, GGUFInitParams], c_void_p),
        "gguf_free": ([c_void_p], None),
        "gguf_find_key": ([c_void_p, c_char_p], c_int64),
        "gguf_get_kv_type": ([c_void_p, c_int64], c_int),
        "gguf_get_val_u32": ([c_void_p, c_int64], c_uint32),
        "gguf_get_val_str": ([c_void_p, c_int64], c_char_p),
        "gguf_get_arr_n": ([c_void_p, c_int64], c_size_t),
        "gguf_get_arr_data": ([c_void_p, c_int64], c_void_p),
        "gguf_get_arr_type": ([c_void_p, c_int64], c_int),
        "gguf_get_n_tensors": ([c_void_p], c_int64),
        "gguf_get_tensor_name": ([c_void_p, c_int64], c_char_p),
        "gguf_get_tensor_size": ([c_void_p, c_int64], c_size_t),
        # ggml.h: (type, src f32*, dst, start row, n rows, n per row, imatrix) -> bytes written
        # (the converter's K-quant down columns)
        "ggml_quantize_chunk": ([c_int, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_void_p], c_size_t),
        # ggml.h: a type's name (the manifest's type table is checked against it) and its traits
        # (the converter dequantizes rows with their to_float: leanstream_convert/ggml_rows.py)
        "ggml_type_name": ([c_int], c_char_p),
        "ggml_get_type_traits": ([c_int], ctypes.POINTER(TypeTraits)),
        # ggml.h, ggml-backend.h: a matrix product without data, and whether the CPU device runs it
        # from its repack buffer type (stock.repacks)
        "ggml_init": ([InitParams], c_void_p),
        "ggml_free": ([c_void_p], None),
        "ggml_new_tensor_2d": ([c_void_p, c_int, c_int64, c_int64], c_void_p),
        "ggml_mul_mat": ([c_void_p, c_void_p, c_void_p], c_void_p),
        "ggml_backend_dev_backend_reg": ([c_void_p], c_void_p),
        "ggml_backend_reg_get_proc_address": ([c_void_p, c_char_p], c_void_p),
        "ggml_backend_buft_name": ([c_void_p], c_char_p),
        "ggml_backend_buft_alloc_buffer": ([c_void_p, c_size_t], c_void_p),
        "ggml_backend_buffer_free": ([c_void_p], None),
        "ggml_backend_dev_supports_op": ([c_void_p, c_void_p], c_bool),
    },
    GGML: {
        # ggml-backend.h: the backend registry (_native: LEANSTREAM_GGML_CPU)
        "ggml_backend_reg_count": ([], c_size_t),
        "ggml_backend_load": ([c_char_p], c_void_p),
        "ggml_backend_dev_by_type": ([c_int], c_void_p),
    },
}


def lib_dir() -> Path:
    """llama.cpp's shared libraries in the installed llama-cpp-python (``llama_cpp/lib``)."""
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


@functools.cache
def _library(soname: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(lib_dir() / soname))
    for name, (args, res) in SIGNATURES[soname].items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
    return lib


def base() -> ctypes.CDLL:
    """libggml-base, as libllama uses it, its SIGNATURES declared."""
    return _library(BASE)


def ggml() -> ctypes.CDLL:
    """libggml (the backend registry libllama uses), its SIGNATURES declared."""
    return _library(GGML)

