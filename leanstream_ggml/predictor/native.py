"""Python owner of the C predictor (native/src/predictor.c). No torch: runtime-safe."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class NativePredictor:
    """One loaded `blk.<il>.lspred`; `close()` (or `with`) frees the C handle."""

    def __init__(self, source):
        from .._native import check, ffi, lib

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
        from .._native import check

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
