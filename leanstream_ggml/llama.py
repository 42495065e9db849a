"""The drop-in ``Llama``: llama_cpp.Llama over a converted model directory.

Everything llama-cpp-python does (completion, chat with the GGUF's template, streaming,
tokenize, the server) works unchanged: the base model (every non-FFN tensor and all metadata)
is loaded by the patched libllama, and each layer's FFN is handed to libleanstream through the
per-context hook ``llama_set_ffn_builder``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp

from . import manifest as manifest_mod
from .engine import FFNEngine

_lib = llama_cpp.llama_cpp._lib
_lib.llama_set_ffn_builder.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
_lib.llama_set_ffn_builder.restype = None


def _is_gguf_file(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


class Llama(llama_cpp.Llama):
    """llama_cpp.Llama whose FFN layers stream from a LeanStream model directory.

    Args:
        model_path: a directory written by ``leanstream convert``.
        memory_budget: bytes of FFN weights kept in RAM (int, or "512MiB"/"1.5GB"); None = all.
        mode: "dense" (every neuron: reproduces stock llama.cpp), or a sparse decode mode that
            computes only the top (1 - sparsity) of each layer's neuron blocks, chosen by the
            model's predictors: "leanstream" (priority-ordered stages, prefetch of the next layer
            refined from partial results, calibration-hot blocks pinned like powerinfer2's and
            priority eviction for the rest), "oneshot" (DejaVu: one layer-ahead prediction, no
            weight cache), "dejavu+" (oneshot + LRU cache), "powerinfer2" (hot blocks pinned +
            LRU). Prefill is always dense.
        sparsity: fraction of blocks skipped per token in sparse modes (default 0.5).
        n_stages: compute stages per layer = refinement points in "leanstream" mode (default 4:
            with the quick predictors 8 stages measured worse, see README).
        n_io_threads: I/O worker threads (reads in flight).
        hot_fraction: "powerinfer2" and "leanstream": share of the budget pinned for the blocks
            most often active in calibration (default 0.5; 0 pins nothing).
        Every other argument is llama_cpp.Llama's, with the same meaning.
    """

    def __init__(self, model_path: str, *, memory_budget: int | str | None = None, mode: str = "dense",
                 sparsity: float | None = None, n_stages: int = 4, n_io_threads: int = 16,
                 hot_fraction: float = 0.5, **kwargs):
        path = Path(model_path)
        if path.is_file() and _is_gguf_file(path):
            raise ValueError(f"{model_path} is a plain GGUF file; convert it first:\n"
                             f"    leanstream convert {model_path} {path.with_suffix('.lsm')}\n"
                             f"then load the directory {path.with_suffix('.lsm')}")
        if not path.is_dir():
            raise ValueError(f"model directory does not exist: {model_path}")
        self._engine = None
        self.manifest = manifest_mod.load(path)
        self.model_dir = path
        predictor_paths = None
        if mode != "dense":
            ready, why = self.manifest.sparse_modes(path)
            if not ready:   # (powerinfer2's calibration frequencies are checked where they are read)
                raise ValueError(f"mode={mode!r} needs the model's predictors, and {model_path} has none usable "
                                 f"({why}): convert with predictors (`leanstream convert SRC {model_path} --force`) "
                                 f"or use mode='dense'")
            predictor_paths = [path / f for f in self.manifest.predictor["files"]]
        if sparsity is None:
            sparsity = 0.0 if mode == "dense" else 0.5
        self._engine = FFNEngine([self.manifest.layer_path(path, il) for il in range(self.manifest.n_layer)],
                                 activation=self.manifest.activation, memory_budget=memory_budget, mode=mode,
                                 n_io_threads=n_io_threads, sparsity=sparsity, n_stages=n_stages,
                                 predictor_paths=predictor_paths)
        self.mode, self.sparsity = mode, sparsity
        self.hot_blocks = 0
        if mode in ("powerinfer2", "leanstream") and hot_fraction > 0:
            self._pin_hot_blocks(path, hot_fraction, required=mode == "powerinfer2")
        super().__init__(str(self.manifest.base_path(path)), **kwargs)
        _lib.llama_set_ffn_builder(self._ctx.ctx, FFNEngine.builder_address(), self._engine.address)
        # the op's I/O errors surface as a Python exception right after the decode that hit them
        ctx_decode = self._ctx.decode

        def decode(batch):
            ctx_decode(batch)
            self._engine.raise_pending()

        self._ctx.decode = decode

    def _pin_hot_blocks(self, path: Path, hot_fraction: float, required: bool = True) -> None:
        """The blocks most often in the top half during calibration, across all layers, stay
        resident; they fill hot_fraction of the budget (never the working set). The predictors'
        per-block prior is most of what they know (README: predictors), so the blocks a static
        hot set holds are hit by almost every token."""
        import numpy as np

        rel = (self.manifest.predictor or {}).get("block_freq")
        if not rel or not (path / rel).exists():
            if not required:
                return
            raise ValueError(f"mode='powerinfer2' needs calibration frequencies ({path}/predictor/block_freq.npy): "
                             f"re-convert with predictors")
        freq = np.load(path / rel)                       # [n_layer, n_blocks]
        stride = max(le.block_stride for le in self.manifest.layers)
        budget = self._engine.memory_budget
        total = sum(le.n_blocks for le in self.manifest.layers)
        slots = total if not budget else min(total, budget // stride)
        working = max(int((1.0 - self.sparsity) * le.n_blocks + 0.5) for le in self.manifest.layers)
        n_hot = max(0, min(int(hot_fraction * slots), slots - 2 * working))
        if n_hot == 0:
            return
        order = np.argsort(-freq, axis=None, kind="stable")[:n_hot]
        layer, block = np.unravel_index(order, freq.shape)
        for il in range(self.manifest.n_layer):
            self._engine.set_hot_blocks(il, block[layer == il])
        self.hot_blocks = n_hot

    @property
    def engine(self) -> FFNEngine:
        return self._engine

    def stats(self, layer: int | None = None) -> dict:
        """Engine counters (DESIGN §5): blocks computed/read, bytes, miss ratio, stalls, ..."""
        return self._engine.stats(layer)

    def reset_stats(self) -> None:
        self._engine.reset_stats()

    def close(self) -> None:
        # the context (whose graphs point at the engine) goes first, then the engine
        if hasattr(self, "_stack"):
            super().close()
        if getattr(self, "_engine", None) is not None:
            self._engine.close()
            self._engine = None
