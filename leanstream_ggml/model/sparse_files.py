"""What a sparse mode reads from a model directory, by what the engine's mode table says it uses.

``Manifest.mode_files`` / ``Manifest.sparse_modes`` (manifest.py) answer through this module:
a mode's capabilities come from the engine (``_native.mode_uses``: "sketch", "predictors",
"rank", "needs_rank", "sparse"); the files are the manifest's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# architectures the sparse modes cannot run on, and why: their op needs the residual entering the
# FFN (native/src/graph.c), which the patched build_ffn finds by the name the model's graph gives
# it (ffn_inp-<il> or sa_out-<il>: patches/0001); dense mode needs none
# architectures the layer-ahead predictors are trained for (the profile also reads gemma3's graph,
# sa_out / ffn_geglu, for the order stage; predictors on gemma3, whose FFN output is normed again
# before the residual add, have not been trained or measured): the others get no predictors
PREDICTOR_ARCHS = ("llama", "qwen2")
# (none since patches/0006 names phi3's residual too; an architecture added here runs dense only)
DENSE_ONLY_ARCHS: dict[str, str] = {}


class ModeFilesError(ValueError):
    """A sparse mode cannot run on this model directory: ``reason`` says what it lacks."""

    def __init__(self, mode: str, reason: str, fix: str):
        super().__init__(f"mode={mode!r} {reason}: {fix}")
        self.mode, self.reason = mode, reason


@dataclass(frozen=True)
class ModeFiles:
    """What one sparse mode reads from a model directory (relative paths; empty: not used)."""
    sketches: list[str]
    predictors: list[str]
    block_freq: str | None


def mode_files(m, model_dir: str | os.PathLike, uses: frozenset[str], mode: str) -> ModeFiles:
    """The files of manifest m's directory a sparse mode reads, given what it uses: its sketch and
    predictor files where it uses them and all are present, the block frequencies where it ranks
    a hot set and they are present. ModeFilesError (a ValueError) saying what is missing and how
    to get it when the mode has none of the selectors it uses, or lacks a ranking it needs."""
    d = Path(model_dir)
    if m.architecture in DENSE_ONLY_ARCHS:
        raise ModeFilesError(mode, f"cannot run on {m.architecture}: {DENSE_ONLY_ARCHS[m.architecture]}",
                             "use mode='dense'")

    def present(files: list[str]) -> bool:
        return bool(files) and all((d / f).is_file() for f in files)

    sketches = m.sketch_files() if "sketch" in uses and present(m.sketch_files()) else []
    predictors = m.predictor_files() if "predictors" in uses and present(m.predictor_files()) else []
    freq = m.block_freq_file() if "rank" in uses else None
    freq = freq if freq and (d / freq).is_file() else None
    if not sketches and not predictors:
        missing = next((f for f in m.predictor_files() if not (d / f).is_file()), None)
        reason = (f"needs predictors (predictor file {missing} is missing)" if missing else
                  "needs a sketch or predictors" if "sketch" in uses else "needs predictors")
        fix = "" if "sketch" in uses else " --predictors quick"
        raise ModeFilesError(mode, reason, f"convert again (`leanstream convert SRC {d} --force{fix}`) or use "
                                           f"mode='dense'")
    if "needs_rank" in uses and not freq:
        raise ModeFilesError(mode, "needs the calibration block frequencies",
                             "convert again with --predictors quick")
    return ModeFiles(sketches=sketches, predictors=predictors, block_freq=freq)


def sparse_modes(m, model_dir: str | os.PathLike) -> tuple[list[str], str | None]:
    """(sparse modes manifest m's directory can run, in the engine's order; why the others cannot,
    or None)."""
    from leanstream_ggml.native._native import MODES, mode_uses   # the engine's mode table (lazy: the manifest stays light)

    if m.architecture in DENSE_ONLY_ARCHS:
        return [], f"{m.architecture}: {DENSE_ONLY_ARCHS[m.architecture]}"
    ready, why = [], {}
    for mode in MODES:
        uses = mode_uses(mode)
        if "sparse" not in uses:
            continue   # dense
        try:
            mode_files(m, model_dir, uses, mode)
            ready.append(mode)
        except ModeFilesError as e:
            why.setdefault(e.reason, []).append(mode)
    if not ready and not m.sketch_files() and not m.predictor_files():
        return [], "no sketch and no predictors (convert again without --sketch none)"
    return ready, "; ".join(f"{', '.join(modes)}: {reason}" for reason, modes in why.items()) or None
