"""The converter: GGUF -> model directory, as a pipeline of restartable stages.

    from converters import convert                 # = converters.stages.convert_model
    m = convert("model.gguf", "model.lsm")         # -> Manifest; what `leanstream convert` runs

    read      open and check the source, its sha256, the block geometry (k, align, neuron order)
    order     (with the sketch, k = 1) how often each neuron is read on the calibration text, and
              neurons read together placed together on disk (converters/order.py) -> <work>/order.npz
    profile   (with predictors) llama.cpp's activations on calibration text    -> <work>/profile/
    train     (with predictors) one predictor per layer, resumable per layer   -> predictor/
    write     base.gguf + ffn/blk.<il>.bin, resumable per layer                -> base.gguf, ffn/
    sketch    (unless sketch="none") low-bit gate/up rows, resumable per layer -> sketch/
    vocab     the speculative draft's vocabulary: tokens by the model's mean predicted probability
              on the calibration corpus (converters/vocab.py)                  -> draft/vocab.npy
    calibrate (with the sketch) perplexity cost of each sparsity per domain of the calibration
              corpus (prose, code, chat, the user's file; converters/calibrate.py)
    manifest  manifest.json, written once, last: its presence marks a complete model directory

The default (a q2_K sketch, no predictors) trains nothing: leanstream mode selects from each
layer's own input with the sketch, and the conversion takes minutes. Predictors (layer-ahead
speculation for leanstream's prefetch, and the baselines' selection) are trained on request.

While a conversion is unfinished, OUT/.convert/ holds its state: ``state.json`` (the source's
sha256 and every parameter the outputs depend on) and one ``<stage>.done`` marker per finished
stage (the profile too, unless ``profile_dir`` puts it elsewhere). Re-running the same command
after an interruption (Ctrl-C, SIGKILL, power loss) resumes at the first unfinished stage and
produces the same files; other parameters are refused unless ``force`` starts over. Every file is
written under a temporary name and renamed, so no stage leaves a half file under a final name.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from leanstream_ggml import manifest as mf

from .convert_gguf import (DEFAULT_DOWN_TYPE, PREDICTOR_ARCHS, ConvertError, check_out_dir_apart, make_manifest, read_source,
                           remove_partials, save_manifest, write_model)
from .fileio import PARTIAL, atomic_write_json, atomic_writer, fsync_dir, sha256_file
from .order import DEFAULT_METHOD as DEFAULT_ORDER, METHODS as ORDER_METHODS
from .sketch import DEFAULT_TYPE as DEFAULT_SKETCH, write_sketches

STATE_DIR = ".convert"     # the converter's own state while a conversion is unfinished
STATE_NAME = "state.json"
PREDICTOR_CHOICES = ("full", "quick", "none")


class _State:
    """OUT/.convert/: the parameters of an unfinished conversion and its stage markers."""

    def __init__(self, out: Path):
        self.dir = out / STATE_DIR

    def load(self) -> dict | None:
        try:
            return json.loads((self.dir / STATE_NAME).read_text())
        except (OSError, ValueError):
            return None

    def start(self, params: dict) -> None:
        self.dir.mkdir(exist_ok=True)
        atomic_write_json(self.dir / STATE_NAME, params)

    def done(self, stage: str) -> bool:
        return (self.dir / f"{stage}.done").exists()

    def mark(self, stage: str, result: Any = None) -> None:
        atomic_write_json(self.dir / f"{stage}.done", {"stage": stage, "result": result})

    def result(self, stage: str) -> Any:
        try:
            return json.loads((self.dir / f"{stage}.done").read_text()).get("result")
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _clean_outputs(out: Path) -> None:
    """Remove what a conversion writes (and nothing else); the manifest first, so the directory
    never looks complete while it is being rewritten."""
    (out / mf.MANIFEST_NAME).unlink(missing_ok=True)
    shutil.rmtree(out / STATE_DIR, ignore_errors=True)
    shutil.rmtree(out / mf.PREDICTOR_DIR, ignore_errors=True)
    shutil.rmtree(out / mf.SKETCH_DIR, ignore_errors=True)
    shutil.rmtree(out / mf.DRAFT_DIR, ignore_errors=True)
    for name in (mf.BASE_NAME, mf.BASE_NAME + PARTIAL, mf.MANIFEST_NAME + PARTIAL, ".convert-state.json"):
        (out / name).unlink(missing_ok=True)
    if (out / mf.FFN_DIR).is_dir():
        for p in out.glob(mf.BLOCK_FILE.format(il="*") + "*"):
            p.unlink()


def _prepare_out_dir(out: Path, params: dict, force: bool) -> bool:
    """Create/check OUT_DIR for a conversion with these parameters. Returns True when resuming an
    interrupted run of the same conversion."""
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    state = _State(out)
    resume = False
    if any(out.iterdir()):
        old = state.load()
        if force:
            _clean_outputs(out)
        elif (out / mf.MANIFEST_NAME).exists():
            raise ConvertError(f"{out}: already holds a converted model (manifest.json); "
                               f"use --force to overwrite it")
        elif old is None:
            raise ConvertError(f"{out}: directory is not empty and holds no interrupted conversion; "
                               f"choose an empty or new directory, or use --force")
        elif old != params:
            changed = sorted(k for k in set(old) | set(params) if old.get(k) != params.get(k))
            raise ConvertError(f"{out}: holds an interrupted conversion of another source or with other "
                               f"parameters ({', '.join(changed)}); re-run it as it was, or use --force to start over")
        else:
            resume = True
    if not resume:
        state.start(params)
    for folder in (out, out / mf.FFN_DIR, out / mf.PREDICTOR_DIR, out / mf.SKETCH_DIR):
        if folder.is_dir():
            for p in folder.glob("*" + PARTIAL):
                p.unlink()   # left by an interrupted write
    return resume


def _calibration_id(calibration) -> Any:
    if calibration is None:
        return None
    return {"file": Path(calibration).name, "sha256": sha256_file(calibration)}


def _corpus_id(calibration) -> dict:
    """The calibration corpus (bundled domains + the user's file) by content: a resumed
    conversion whose corpus changed starts its order and calibrate stages again."""
    from .calibrate import corpus

    return {name: sha256_file(p)[:16] for name, p in corpus(calibration).items()}


def convert_model(src: str | os.PathLike, out_dir: str | os.PathLike, *, k: int = 1, align: int | None = None,
                  force: bool = False, progress: bool = True, permutation=None,
                  predictors: str = "none", sketch: str = DEFAULT_SKETCH, calibrate: bool = True, profile_dir: str | os.PathLike | None = None, calibration=None,
                  hash_config: dict | None = None, profile_kwargs: dict | None = None, n_threads: int = 2,
                  order: str = DEFAULT_ORDER, log: Callable[..., None] | None = None,
                  down_type: str = DEFAULT_DOWN_TYPE) -> mf.Manifest:
    """Convert GGUF ``src`` into the model directory ``out_dir``; returns its Manifest. The
    defaults are `leanstream convert`'s (converters/cli.py passes only what its user gives).

    k: neurons per block. align: O_DIRECT alignment of blocks (default: the logical block size of
    the device holding out_dir, at least 512). force: overwrite a directory holding another or a
    complete conversion. permutation: order of neuron ids (blocks take k consecutive ids of it;
    identity by default), one for all layers or one per layer. down_type: the format of the
    ffn_down columns of a quantized source (``convert_gguf.down_columns``): "auto" (default)
    is Q6_K where the source's ffn_down has at most 6.56 bits and n_embd is a multiple of 256,
    else Q8_0; "q8_0", "q6_k", "q5_k" choose one.
    predictors: "full" (profile the model on its own answers to the bundled prompts, or on
    ``calibration`` text, and train one predictor per layer), "quick" (a CI-sized profile and
    training) or "none" (default: no training). sketch: the sketch row format ("ls2", default)
    or "none" (with predictors "none" too: dense mode only, seconds). calibrate: measure what
    each sparsity costs on the model's own text (the quality= table; with the sketch). profile_dir: keep the activation profile
    there (reused if complete); by default it lives in OUT/.convert/ and is removed at the end.
    hash_config / profile_kwargs: override the training / profiling settings of the choice.
    order: on-disk neuron order, "importance" (default), "coact", "freq" or "none" (GGUF order;
    converters/order.py); only with one neuron per block, no ``permutation`` and a sketch.
    Raises ConvertError.
    """
    if predictors not in PREDICTOR_CHOICES:
        raise ConvertError(f"predictors must be one of {', '.join(PREDICTOR_CHOICES)}, got {predictors!r}")
    from .sketch import TYPES as SKETCH_TYPES

    if order not in ORDER_METHODS:
        raise ConvertError(f"order must be one of {', '.join(ORDER_METHODS)}, got {order!r}")
    if sketch != "none" and sketch not in SKETCH_TYPES:
        raise ConvertError(f"sketch must be one of {', '.join(SKETCH_TYPES)} or none, got {sketch!r}")
    log = log or (lambda *a: print(*a, file=sys.stderr))
    out = Path(out_dir)
    check_out_dir_apart(Path(src), out)
    try:
        return _convert_model(src, out, k=k, align=align, force=force, progress=progress, permutation=permutation, order=order,
                              predictors=predictors, sketch=sketch, calibrate=calibrate, profile_dir=profile_dir, calibration=calibration,
                              hash_config=hash_config, profile_kwargs=profile_kwargs, n_threads=n_threads, log=log,
                              down_type=down_type)
    except OSError as e:
        remove_partials(out)
        if e.errno is None:   # numpy's tofile reports a short write without errno
            raise ConvertError(f"{out}: writing failed ({e}): the disk is full or a file size limit was "
                               f"reached; free some space or choose another output directory") from None
        raise
    except BaseException:
        remove_partials(out)
        raise


def _convert_model(src, out: Path, *, k, align, force, progress, permutation, order, predictors, sketch, calibrate, profile_dir, calibration,
                   hash_config, profile_kwargs, n_threads, log, down_type) -> mf.Manifest:
    # read: the source, its hash and the block geometry
    source = read_source(src, out, k=k, align=align, permutation=permutation, progress=progress,
                         down_type=down_type)
    if predictors != "none" and source.model.arch not in PREDICTOR_ARCHS:
        log(f"no predictors: the predictor stage supports {', '.join(PREDICTOR_ARCHS)}, not "
            f"{source.model.arch}, yet; {out} runs in dense mode")
        predictors = "none"
    params = source.params()
    if sketch != "none" and source.model.n_embd % 64:
        log(f"no sketch: the {sketch} rows need n_embd a multiple of 64, the model "
            f"has {source.model.n_embd}; leanstream mode needs predictors here")
        sketch = "none"
    if sketch != "none":
        from .sketch import DEFAULT_WEIGHT

        params["sketch"] = {"type": sketch, "weight": DEFAULT_WEIGHT, "calibrate": bool(calibrate),
                            "calibration": _corpus_id(calibration) if calibrate else None}
    if predictors != "none":
        from .train.pipeline import training_settings

        params["predictors"] = training_settings(predictors, hash_config=hash_config, profile_kwargs=profile_kwargs,
                                                 calibration=_calibration_id(calibration))
    # the order stage (the neuron order, and the hot set's ranking for leanstream without
    # predictors): one neuron per block, no given order, a sketch
    profile_order = k == 1 and permutation is None and sketch != "none"
    if profile_order:
        params["order"] = {"method": order, "calibration": _corpus_id(calibration)}
    resume = _prepare_out_dir(out, params, force)
    state = _State(out)
    if resume and progress:
        done = [s for s in ("order", "profile", "train", "write", "sketch", "vocab", "calibrate") if state.done(s)]
        log(f"resuming an interrupted conversion of {source.path.name}"
            + (f" (finished: {', '.join(done)})" if done else ""))

    # order: neurons read together placed together (before anything is written in slot order)
    block_freq = block_absh = None
    if profile_order:
        source.orders, block_freq, block_absh = _neuron_orders(source, state, order, calibration, n_threads, progress, log)

    predictor = None
    if predictors != "none":
        from .train.pipeline import build_predictors

        predictor = build_predictors(
            source.path, out, state_dir=state.dir, blocks_of_layer=_blocks_of_layer(source), quick=predictors == "quick",
            calibration=calibration, profile_dir=profile_dir, cfg=hash_config, profile_kwargs=profile_kwargs,
            n_threads=n_threads, progress=progress, log=log)

    # write: base.gguf and the block files (a layer already complete is kept)
    entries, totals, kept = write_model(source, out, progress=progress)
    state.mark("write")

    # sketch: the exact-input scorer's rows (a layer already complete is kept)
    sketch_info = None
    if sketch != "none":
        sketch_info = write_sketches(source, out, type_name=sketch, weight=params["sketch"]["weight"],
                                     progress=progress, block_freq=block_freq, block_abs_h=block_absh)
        state.mark("sketch")

    m = make_manifest(source, out, entries, totals, predictor)
    m.sketch = sketch_info

    # vocab: the rows the speculative draft's output projection computes
    if not state.done("vocab"):
        from .calibrate import corpus
        from .vocab import vocab_ranking

        ranking = vocab_ranking(source.path, list(corpus(calibration).values()), n_threads=n_threads, progress=progress)
        (out / mf.DRAFT_DIR).mkdir(exist_ok=True)
        with atomic_writer(out / mf.DRAFT_VOCAB) as f:
            np.save(f, ranking, allow_pickle=False)
        state.mark("vocab")
    m.extra["draft"] = {"vocab": mf.DRAFT_VOCAB}

    # calibrate: what each sparsity costs on the model's own text (quality="ppl+5%" reads it)
    if sketch_info is not None and calibrate:
        if state.done("calibrate"):
            sketch_info.quality = state.result("calibrate") or []
        else:
            from .calibrate import calibrate as run_calibration

            m.record_checksums(out)      # the model runs before its manifest exists
            sketch_info.quality = run_calibration(source.path, out, m, text_path=calibration, n_threads=n_threads,
                                                  progress=progress, log=log)
            state.mark("calibrate", sketch_info.quality)

    # manifest: once, last
    fsync_dir(out)
    save_manifest(m, out)
    state.remove()
    if progress and kept and not resume:
        log(f"kept {kept} of {m.n_layer} block files already complete")
    return m


def _neuron_orders(source, state: _State, method: str, calibration, n_threads: int, progress: bool, log):
    """The order stage (converters/order.py); its result is kept in OUT/.convert/ for a resume."""
    import numpy as np

    from leanstream_ggml.engine import candidate_blocks

    from .calibrate import corpus
    from .order import CANDIDATE_RATIO, SPARSITY, neuron_orders
    from .profile import UnsupportedProfile
    from .sketch import down_column_norms

    path = state.dir / "order.npz"
    if state.done("order"):
        with np.load(path) as z:
            return ([z[f"l{il}"] for il in range(source.model.n_layer)], z["freq"] if "freq" in z else None,
                    z["absh"] if "absh" in z else None)
    try:
        orders, freq, absh = neuron_orders(source.path, list(corpus(calibration).values()), method=method,
                                           n_read_of=lambda n: candidate_blocks(n, SPARSITY, CANDIDATE_RATIO),
                                           down_norm=lambda il: down_column_norms(source.model.layers[il], source.model.n_embd),
                                           n_threads=n_threads, progress=progress, log=log)
    except UnsupportedProfile as e:
        # (an architecture whose graph names none of the tensors the profile captures) the model keeps
        # GGUF order and no hot-set ranking
        log(f"order: {e}; neurons stay in GGUF order")
        orders, freq, absh = source.orders, None, None
    tmp = state.dir / "order.partial.npz"
    np.savez(tmp, **({} if freq is None else {"freq": freq, "absh": absh}), **{f"l{il}": o for il, o in enumerate(orders)})
    tmp.replace(path)
    state.mark("order")
    return orders, freq, absh


def _blocks_of_layer(source):
    """The block geometry the predictors are trained for: None (one neuron per block, file order
    = neuron order) or per layer (slots, k) with block b = neurons slots[b*k:(b+1)*k], -1 padding."""
    import numpy as np

    if source.k == 1 and all(np.array_equal(o, np.arange(len(o))) for o in source.orders):
        return None
    return [(source.slots(il), source.k) for il in range(source.model.n_layer)]
