"""The converter: GGUF -> model directory, as a pipeline of restartable stages, all within one
memory limit (converters/budget.py; docs/design.md §22).

    from converters import convert                 # = converters.stages.convert_model
    m = convert("model.gguf", "model.lsm")         # -> Manifest; what `leanstream convert` runs

    read        open and check the source, its sha256, the block geometry; the disk space and the
                limit checked before anything is written
    write       base.gguf + ffn/blk.<il>.bin in source order, one layer at a time -> base.gguf, ffn/
    activations one pass of the plugin's dense engine (the exact reference) over the calibration
                corpus, under the limit: per-neuron |h| and read-set statistics, the draft
                vocabulary's ranking, the calibration references (converters/profile_pass.py)
                                                                     -> <work>/activations.npz
    order       (with the sketch, k = 1) each layer's neuron order (converters/order.py)
                                                                     -> <work>/order.npz
    reorder     each block file rewritten in that order, one layer at a time, in place
    profile     (with predictors) llama.cpp's activations on calibration text    -> <work>/profile/
    train       (with predictors) one predictor per layer, resumable per layer   -> predictor/
    sketch      (unless sketch="none") low-bit gate/up rows, resumable per layer -> sketch/
    vocab       the speculative draft's vocabulary (from the activations stage)  -> draft/vocab.npy
    calibrate   (opt-in, with the sketch) perplexity cost of each sparsity per domain of the
                calibration corpus against the activations stage's references (converters/calibrate.py)
    manifest    manifest.json, written once, last: its presence marks a complete model directory;
                extra.conversion holds each stage's seconds and peak resident memory

The default (an ls2 sketch, no predictors, no calibration) trains nothing and runs the model
once. Predictors (layer-ahead speculation for leanstream's prefetch, and the baselines'
selection) are trained on request; their profile still runs stock llama.cpp on the source,
outside the limit.

While a conversion is unfinished, OUT/.convert/ holds its state: ``state.json`` (the source's
sha256 and every parameter the outputs depend on), one ``<stage>.done`` marker per finished
stage and ``stages.json`` (what each measured). Re-running the same command after an
interruption (Ctrl-C, SIGKILL, power loss) resumes at the first unfinished stage and produces the
same files; other parameters are refused unless ``force`` starts over. Every file is written
under a temporary name and renamed, so no stage leaves a half file under a final name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from leanstream_ggml import manifest as mf

from leanstream_ggml import params as params_mod

from .budget import StageMeter, machine_limit
from .convert_gguf import (DEFAULT_DOWN_TYPE, PREDICTOR_ARCHS, ConvertError, check_fits, check_out_dir_apart, make_manifest,
                           read_source, remove_partials, reorder_layers, save_manifest, write_model)
from .fileio import PARTIAL, atomic_write_json, atomic_writer, fsync_dir, sha256_file
from .order import DEFAULT_METHOD as DEFAULT_ORDER, METHODS as ORDER_METHODS
from .profile_pass import MAX_TOKENS as PROFILE_TOKENS
from .sketch import DEFAULT_TYPE as DEFAULT_SKETCH, write_sketches

STATE_DIR = ".convert"     # the converter's own state while a conversion is unfinished
STATE_NAME = "state.json"
PREDICTOR_CHOICES = ("full", "quick", "none")
STAGES = ("write", "activations", "order", "reorder", "profile", "train", "sketch", "calibrate")


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

    def load_records(self) -> dict:
        """What the finished stages of an interrupted run measured (StageMeter.records)."""
        try:
            return json.loads((self.dir / "stages.json").read_text())
        except (OSError, ValueError):
            return {}

    def save_records(self, records: dict) -> None:
        atomic_write_json(self.dir / "stages.json", records)

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
                  predictors: str = "none", sketch: str = DEFAULT_SKETCH, calibrate: bool = False, profile_dir: str | os.PathLike | None = None, calibration=None,
                  hash_config: dict | None = None, profile_kwargs: dict | None = None, n_threads: int = 2,
                  order: str = DEFAULT_ORDER, log: Callable[..., None] | None = None,
                  down_type: str = DEFAULT_DOWN_TYPE, memory_limit: int | str | None = None,
                  profile_tokens: int = PROFILE_TOKENS) -> mf.Manifest:
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
    each sparsity costs on the calibration corpus (the quality= table; with the sketch; off by
    default: only quality= reads it, and it takes longer than the rest of the conversion).
    memory_limit: bytes (or "1GB") the whole conversion holds (default: what the machine or its
    memory cgroup allows this process, converters/budget.py). profile_tokens: positions of the
    calibration corpus the activations stage runs the model on (more: steadier statistics,
    proportionally longer). profile_dir: keep the activation profile
    there (reused if complete); by default it lives in OUT/.convert/ and is removed at the end.
    hash_config / profile_kwargs: override the training / profiling settings of the choice.
    order: on-disk neuron order, "importance" (default), "coact", "freq" or "none" (GGUF order;
    converters/order.py); only with one neuron per block, no ``permutation`` and a sketch.
    Raises ConvertError.
    """
    if not isinstance(profile_tokens, int) or isinstance(profile_tokens, bool) or profile_tokens < 1:
        raise ConvertError(f"profile_tokens must be a positive integer, got {profile_tokens!r}")
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
                              down_type=down_type, memory_limit=memory_limit, profile_tokens=profile_tokens)
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
                   hash_config, profile_kwargs, n_threads, log, down_type, memory_limit, profile_tokens) -> mf.Manifest:
    # the limit the whole conversion holds, shown before the first stage
    if memory_limit is None:
        limit, limit_why = machine_limit()
    else:
        limit, limit_why = params_mod.size_bytes(memory_limit, "memory_limit"), "given"
    log(f"memory limit {limit / 1e6:.0f} MB ({limit_why})")
    # read: the source, its hash and the block geometry
    meter = StageMeter(log)
    with meter.stage("read"):
        source = read_source(src, out, k=k, align=align, permutation=permutation, progress=progress,
                             down_type=down_type)
    read_record = dict(meter.records)
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
    params["activations"] = {"tokens": profile_tokens, "calibration": _corpus_id(calibration)}
    resume = _prepare_out_dir(out, params, force)
    state = _State(out)
    try:   # before any model file is written (after the directory: a place that cannot be written says so first)
        check_fits(source, out, limit, sketch=sketch)
    except ConvertError:
        if not resume:
            _clean_outputs(out)
            with contextlib.suppress(OSError):
                out.rmdir()       # only if empty: the user's own files stay
        raise
    if resume and progress:
        done = [s for s in STAGES if state.done(s)]
        log(f"resuming an interrupted conversion of {source.path.name}"
            + (f" (finished: {', '.join(done)})" if done else ""))

    meter = StageMeter(log, state.load_records(), on_record=state.save_records)
    meter.records.update(read_record)

    # write: base.gguf and the block files in source order (a layer already complete is kept; once
    # the stage is done the files are the reorder stage's, so it is not entered again)
    with meter.stage("write", done=state.done("write")):
        entries, totals, kept = write_model(source, out, progress=progress, write=not state.done("write"))
        state.mark("write")
    m = make_manifest(source, out, entries, totals, None)
    m.record_checksums(out)      # the model runs before its manifest exists

    # activations: one pass of the dense engine over the calibration corpus, under the limit
    acts = _activations(source, out, m, state, meter, memory_limit=limit, calibration=calibration,
                        neuron_stats=profile_order, coact=profile_order and order == "coact",
                        windows=sketch != "none" and calibrate, max_tokens=profile_tokens, n_threads=n_threads,
                        progress=progress, log=log)

    # order + reorder: each layer's neurons placed in the chosen order, in place
    block_freq = block_absh = down_norm = None
    if profile_order:
        with meter.stage("order", done=state.done("order")):
            source.orders, block_freq, block_absh, down_norm = _neuron_orders(source, state, order, acts, progress, log)
        with meter.stage("reorder", done=state.done("reorder")):
            reorder_layers(source, out, progress=progress)
            state.mark("reorder")

    predictor = None
    if predictors != "none":
        from .train.pipeline import build_predictors

        with meter.stage("predictors", done=state.done("train")):
            predictor = build_predictors(
                source.path, out, state_dir=state.dir, blocks_of_layer=_blocks_of_layer(source), quick=predictors == "quick",
                calibration=calibration, profile_dir=profile_dir, cfg=hash_config, profile_kwargs=profile_kwargs,
                n_threads=n_threads, progress=progress, log=log)
    m.predictor = predictor

    # sketch: the exact-input scorer's rows (a layer already complete is kept, and a finished stage
    # only gives its manifest entry again)
    sketch_info = None
    if sketch != "none":
        with meter.stage("sketch", done=state.done("sketch")):
            sketch_info = write_sketches(source, out, type_name=sketch, weight=params["sketch"]["weight"],
                                         progress=progress, block_freq=block_freq, block_abs_h=block_absh,
                                         down_norm=down_norm, n_threads=n_threads)
            state.mark("sketch")
    m.sketch = sketch_info

    # vocab: the rows the speculative draft's output projection computes
    (out / mf.DRAFT_DIR).mkdir(exist_ok=True)
    with atomic_writer(out / mf.DRAFT_VOCAB) as f:
        np.save(f, np.argsort(-acts.vocab, kind="stable").astype(np.int32), allow_pickle=False)
    m.extra["draft"] = {"vocab": mf.DRAFT_VOCAB}

    # calibrate (opt-in): what each sparsity costs on the corpus (quality="ppl+5%" reads it)
    if sketch_info is not None and calibrate:
        if state.done("calibrate"):
            sketch_info.quality = state.result("calibrate") or []
        else:
            from .calibrate import calibrate as run_calibration

            m.record_checksums(out)
            with meter.stage("calibrate"):
                sketch_info.quality = run_calibration(out, m, acts.references, memory_limit=limit, n_threads=n_threads,
                                                      progress=progress, log=log)
            state.mark("calibrate", sketch_info.quality)

    # manifest: once, last
    m.extra["conversion"] = {"memory_limit": limit, "memory_limit_source": limit_why,
                             "stages": meter.records,
                             "seconds": round(sum(r["seconds"] for r in meter.records.values()), 1),
                             "peak_rss_bytes": max(r["peak_rss_bytes"] for r in meter.records.values())}
    fsync_dir(out)
    save_manifest(m, out)
    state.remove()
    if progress and kept and not resume:
        log(f"kept {kept} of {m.n_layer} block files already complete")
    return m


def _activations(source, out: Path, m, state: _State, meter: StageMeter, *, memory_limit, calibration, neuron_stats: bool,
                 coact: bool, windows: bool, max_tokens: int, n_threads: int, progress: bool, log):
    """The activations stage (converters/profile_pass.py); its result is kept in OUT/.convert/."""
    from leanstream_ggml._native import LeanstreamError
    from leanstream_ggml.engine import candidate_blocks
    from leanstream_ggml.memplan import MemoryPlanError

    from .calibrate import corpus
    from .order import CANDIDATE_RATIO, SPARSITY
    from .profile_pass import MIN_ROWS, PassResult, run_pass

    path = state.dir / "activations.npz"
    if state.done("activations"):
        return PassResult.load(path)
    sets_dir = None
    if coact:
        sets_dir = state.dir / "read_sets"
        sets_dir.mkdir(exist_ok=True)
    texts = corpus(calibration)
    with meter.stage("activations"):
        try:
            res = run_pass(out, m, list(texts.values()), memory_limit=memory_limit, n_threads=n_threads,
                           n_read=candidate_blocks(source.model.n_ff, SPARSITY, CANDIDATE_RATIO) if neuron_stats else None,
                           sets_dir=sets_dir, calibration_windows=texts if windows else None,
                           max_tokens=max_tokens, progress=progress)
        except (MemoryPlanError, LeanstreamError) as e:
            if isinstance(e, LeanstreamError) and "memory budget" not in str(e):
                raise
            raise ConvertError(f"the memory limit of {memory_limit / 1e6:.0f} MB cannot run this model's profile "
                               f"pass (dense mode, a batch of {MIN_ROWS} tokens at least):\n{e}") from None
        res.save(path)
        state.mark("activations")
    if progress:
        log(f"activations: {res.n_tokens} positions of the calibration corpus ({', '.join(texts)}), "
            f"{res.rows} tokens per decode")
    return res


def _neuron_orders(source, state: _State, method: str, acts, progress: bool, log):
    """The order stage (converters/order.py) from the activations stage's statistics; its result
    is kept in OUT/.convert/ for a resume. Returns per layer the neuron order, and [n_layer, n_ff]
    in that order: read frequency, mean |h| and ||down column||."""
    from tqdm import tqdm

    from .convert_gguf import release_source_pages
    from .order import order_layer, runs
    from .sketch import down_column_norms

    model = source.model
    path = state.dir / "order.npz"
    if state.done("order"):
        with np.load(path) as z:
            return ([z[f"l{il}"] for il in range(model.n_layer)], z["freq"], z["absh"], z["down_norm"])
    if acts.abs_h is None:
        raise ConvertError("the activations stage kept no neuron statistics; re-run with --force")
    n = max(acts.n_tokens, 1)
    sets_dir = state.dir / "read_sets"
    orders, freq, absh, norms = [], [], [], []
    before = after = 0.0
    for il in tqdm(range(model.n_layer), desc=f"ordering neurons ({method})", unit="layer", disable=not progress):
        norm = down_column_norms(model.layers[il], model.n_embd)          # f32 [n_ff], GGUF order
        release_source_pages(model)
        mean_abs = (acts.abs_h[il] / n).astype(np.float32)
        sets = None
        if method == "coact":
            bits = np.fromfile(sets_dir / f"l{il}.bits", np.uint8).reshape(acts.n_tokens, -1)
            sets = np.unpackbits(bits, axis=1, count=model.n_ff)       # uint8 [T, n_ff], one layer's
        o = order_layer(method, mean_abs * norm, acts.reads[il], sets)
        if sets is not None and progress:
            before += runs(sets, np.arange(model.n_ff))
            after += runs(sets, o)
        orders.append(o)
        freq.append((acts.reads[il] / n).astype(np.float32)[o])
        absh.append(mean_abs[o])
        norms.append(norm[o])
    if method == "coact" and progress:
        log(f"order: runs of read neurons per token {before:.0f} in GGUF order, {after:.0f} in coact order "
            f"(before read bridging)")
    freq, absh, norms = np.stack(freq), np.stack(absh), np.stack(norms)
    tmp = state.dir / "order.partial.npz"
    np.savez(tmp, freq=freq, absh=absh, down_norm=norms, **{f"l{il}": o for il, o in enumerate(orders)})
    tmp.replace(path)
    state.mark("order")
    return orders, freq, absh, norms


def _blocks_of_layer(source):
    """The block geometry the predictors are trained for: None (one neuron per block, file order
    = neuron order) or per layer (slots, k) with block b = neurons slots[b*k:(b+1)*k], -1 padding."""
    import numpy as np

    if source.k == 1 and all(np.array_equal(o, np.arange(len(o))) for o in source.orders):
        return None
    return [(source.slots(il), source.k) for il in range(source.model.n_layer)]
