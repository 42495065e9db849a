"""The engine's execution modes, as its mode table (native/src/mode.c) defines them.

Callers ask what a mode does instead of comparing its name: ``is_sparse(mode)`` (its decode
computes a selection of each layer's blocks; every mode but dense), ``uses(mode)`` (what it reads
from a model directory: "sketch", "predictors", "rank", "needs_rank"; and "sparse"),
``is_cascade(mode)`` (its decode is the sketch cascade: the streaming controller steers it, and
the converter calibrated its perplexity cost, which quality= reads). ``DEFAULT`` is the mode
``Llama`` runs without mode=, ``QUALITY`` the one quality= implies.

    >>> from leanstream_ggml import modes
    >>> modes.MODES
    ('dense', 'oneshot', 'dejavu+', 'powerinfer2', 'leanstream')
    >>> modes.is_sparse("dense"), sorted(modes.uses("powerinfer2"))
    (False, ['needs_rank', 'predictors', 'rank', 'sparse'])
"""

from __future__ import annotations

from leanstream_ggml.native import _native

MODES: tuple[str, ...] = _native.MODES                    # the engine's order (LS_MODE_*)
DEFAULT: str = MODES[_native.lib.LS_MODE_DENSE]           # every neuron: stock llama.cpp's output
QUALITY: str = MODES[_native.lib.LS_MODE_LEANSTREAM]      # the sparse mode quality= is calibrated for


def uses(mode: str) -> frozenset[str]:
    """What ``mode`` reads and does (ValueError for an unknown mode)."""
    return _native.mode_uses(mode)


def is_sparse(mode: str) -> bool:
    """Its decode computes a selection of each layer's blocks (prefill always runs dense)."""
    return "sparse" in uses(mode)


def is_cascade(mode: str) -> bool:
    """Its decode ops run the sketch cascade (sketch scores -> exact gate/up of the candidates ->
    the kept blocks' down columns): what controller= steers and quality= is calibrated for."""
    return "sketch" in uses(mode)


SPARSE: tuple[str, ...] = tuple(m for m in MODES if is_sparse(m))
