"""The converter: GGUF -> model directory, as a pipeline of restartable stages, all within one
memory limit (leanstream_convert/budget.py; docs/design.md §22).

    from leanstream_convert import convert          # = leanstream_convert.stages.convert_model
    m = convert("model.gguf", "model.lsm")          # -> Manifest; what `leanstream convert` runs

``STAGES`` below is the one list of them: each stage's name, the function that runs it, what it
reads and writes, and whether it leaves a marker. This docstring's table (appended from it), the
meter's records, resume, the resuming message and `leanstream convert --help` all come from it.
A stage with a marker that an interrupted run finished is not run again: its function is called
with ``done=True`` and only gives back what later stages need from its outputs.

The default (an ls2 sketch, no predictors, no calibration) trains nothing and runs the model
once. Predictors (layer-ahead speculation for leanstream's prefetch, and the baselines'
selection) are trained on request; their profile runs stock llama.cpp on the source, outside the
limit. "activations" is the plugin's dense engine over the calibration corpus (statistics for
the order, the draft vocabulary and the calibration); "profile" is stock llama.cpp's FFN inputs
and outputs recorded for predictor training.

While a conversion is unfinished, OUT/.convert/ holds its state (leanstream_convert/state.py). Re-running
the same command after an interruption (Ctrl-C, SIGKILL, power loss) resumes at the first
unfinished stage and produces the same files; other parameters are refused unless ``force``
starts over. Every file is written under a temporary name and renamed, so no stage leaves a half
file under a final name.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from leanstream_ggml.model import manifest as mf
from leanstream_ggml.native import params as params_mod
from leanstream_ggml.model.manifest import PREDICTOR_ARCHS
from leanstream_ggml.memplan import machine_limit

from .activations import MAX_TOKENS, default_tokens
from .budget import StageMeter
from .convert_gguf import (DEFAULT_DOWN_TYPE, ConvertError, check_fits, check_out_dir_apart, make_manifest,
                           read_source, remove_partials, reorder_layers, save_manifest, write_model)
from .fileio import atomic_writer, fsync_dir, sha256_file
from .order import DEFAULT_METHOD as DEFAULT_ORDER, METHODS as ORDER_METHODS
from .sketch import DEFAULT_TYPE as DEFAULT_SKETCH
from .state import State, clean_outputs, prepare_out_dir

PREDICTOR_CHOICES = ("full", "quick", "none")


@dataclass
class Conversion:
    """One conversion as its stages see it: the options, the limit, and what each stage leaves
    for the next (in memory; on disk each stage's outputs are its own)."""

    src: Path
    out: Path
    opts: dict                       # convert_model's keywords (k, align, sketch, predictors, ...)
    log: Callable[..., None]
    limit: int                       # bytes the whole conversion holds
    limit_why: str
    meter: StageMeter
    state: State | None = None       # opened by the read stage
    resume: bool = False
    source: Any = None               # convert_gguf.Source
    params: dict = field(default_factory=dict)   # what the outputs depend on (state.json)
    manifest: mf.Manifest | None = None
    acts: Any = None                 # activations.PassResult
    block_freq: Any = None           # [n_layer, n_ff] in the on-disk order (order stage)
    block_absh: Any = None
    down_norm: Any = None
    sketch_info: Any = None

    @property
    def progress(self) -> bool:
        return self.opts["progress"]

    @property
    def moe(self) -> bool:
        """A mixture-of-experts source: read, write (base.gguf and the expert files) and manifest
        run; the stages that run the model or order neurons do not, yet."""
        return self.source is not None and self.source.model.moe is not None

    @property
    def orders_neurons(self) -> bool:
        """The order stage runs (the neuron order, and the hot set's ranking for leanstream
        without predictors): one neuron per block, no given order, a sketch."""
        return (not self.moe and self.opts["k"] == 1 and self.opts["permutation"] is None
                and self.opts["sketch"] != "none")


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Conversion, bool], Any]    # (conversion, done) -> what its marker keeps
    reads: str
    writes: str
    when: Callable[[Conversion], bool] = lambda c: True
    marker: bool = True                       # resumable: <name>.done in OUT/.convert/ once finished
    timed: bool = True                        # its seconds and peak memory recorded (not the manifest, which holds them)


# ---- the stages, in the order they run ------------------------------------------------------------

def _read(c: Conversion, done: bool) -> None:
    """Open and check the source, its sha256, the block geometry; the parameters the outputs
    depend on; the output directory (or the interrupted conversion in it) and whether the disk
    and the limit can hold the work, before anything is written."""
    o = c.opts
    c.source = read_source(c.src, c.out, k=o["k"], align=o["align"], permutation=o["permutation"],
                           progress=c.progress, down_type=o["down_type"])
    _settle_options(c)
    c.params = _parameters(c)
    c.resume = prepare_out_dir(c.out, c.params, o["force"])
    c.state = State(c.out)
    try:   # after the directory: a place that cannot be written says so first
        check_fits(c.source, c.out, c.limit, sketch=o["sketch"])
    except ConvertError:
        if not c.resume:
            clean_outputs(c.out)
            with contextlib.suppress(OSError):
                c.out.rmdir()       # only if empty: the user's own files stay
        raise


def _write(c: Conversion, done: bool) -> None:
    """base.gguf and the block files in source order (a layer already complete is kept; once the
    stage is done the files are the reorder stage's, so only their entries are made)."""
    entries, totals, kept = write_model(c.source, c.out, progress=c.progress, write=not done)
    c.manifest = make_manifest(c.source, c.out, entries, totals, None)
    c.manifest.record_checksums(c.out)      # the model runs before its manifest exists
    if c.progress and kept and not c.resume:
        c.log(f"kept {kept} of {c.manifest.n_layer} block files already complete")


def _activations(c: Conversion, done: bool) -> None:
    """One pass of the plugin's dense engine over the calibration corpus, under the limit
    (leanstream_convert/activations.py); its result is kept in OUT/.convert/."""
    from leanstream_ggml.native.capi import LeanstreamError
    from leanstream_ggml.native.engine import candidate_blocks
    from leanstream_ggml.memplan import MemoryPlanError

    from .activations import MIN_ROWS, PassResult, run_pass
    from .calibrate import corpus
    from .order import CANDIDATE_RATIO, SPARSITY

    path = c.state.dir / "activations.npz"
    if done:
        c.acts = PassResult.load(path)
        return
    o, sets_dir = c.opts, None
    if c.orders_neurons and o["order"] == "coact":
        sets_dir = c.state.dir / "read_sets"
        sets_dir.mkdir(exist_ok=True)
    texts = corpus(o["calibration"])
    n_read = candidate_blocks(c.source.model.n_ff, SPARSITY, CANDIDATE_RATIO) if c.orders_neurons else None
    try:
        res = run_pass(c.out, c.manifest, list(texts.values()), memory_limit=c.limit, n_threads=o["n_threads"],
                       n_read=n_read, sets_dir=sets_dir,
                       calibration_windows=texts if o["sketch"] != "none" and o["calibrate"] else None,
                       max_tokens=o["profile_tokens"], progress=c.progress)
    except (MemoryPlanError, LeanstreamError) as e:
        if isinstance(e, LeanstreamError) and "memory budget" not in str(e):
            raise
        raise ConvertError(f"the memory limit of {c.limit / 1e6:.0f} MB cannot run this model's activations "
                           f"pass (dense mode, a batch of {MIN_ROWS} tokens at least):\n{e}") from None
    res.save(path)
    c.acts = res
    if c.progress:
        c.log(f"activations: {res.n_tokens} positions of the calibration corpus ({', '.join(texts)}), "
              f"{res.rows} tokens per decode")


def _order(c: Conversion, done: bool) -> None:
    """Each layer's neuron order (leanstream_convert/order.py) from the activations' statistics, and per
    layer in that order: read frequency, mean |h| and ||down column|| (kept in OUT/.convert/)."""
    from .order import neuron_orders

    path = c.state.dir / "order.npz"
    if not done:
        neuron_orders(c.source.model, c.opts["order"], c.acts, c.state.dir / "read_sets", path,
                      progress=c.progress, log=c.log)
    with np.load(path) as z:
        c.source.orders = [z[f"l{il}"] for il in range(c.source.model.n_layer)]
        c.block_freq, c.block_absh, c.down_norm = z["freq"], z["absh"], z["down_norm"]


def _reorder(c: Conversion, done: bool) -> None:
    """Each block file rewritten in the order stage's order, one layer at a time, in place."""
    if not done:
        reorder_layers(c.source, c.out, progress=c.progress)


def _profile(c: Conversion, done: bool) -> dict | None:
    """Stock llama.cpp's FFN activations of the source for predictor training."""
    from .train.pipeline import profile_for_training

    if done:
        return None
    o = c.opts
    return profile_for_training(c.source.path, _profile_dir(c), quick=o["predictors"] == "quick",
                                calibration=o["calibration"], profile_kwargs=o["profile_kwargs"],
                                n_threads=o["n_threads"], progress=c.progress, log=c.log)


def _train(c: Conversion, done: bool) -> dict | None:
    """One predictor per layer (resumable per layer) into predictor/; the profile is removed
    after (unless --profile-dir keeps it)."""
    import shutil

    from .train.pipeline import predictor_info, train_predictors

    o, result = c.opts, None
    if not done:
        prof = c.state.result("profile") or {}
        result = train_predictors(_profile_dir(c), c.source.path, c.out, state_dir=c.state.dir,
                                  blocks_of_layer=_blocks_of_layer(c.source), quick=o["predictors"] == "quick",
                                  cfg=o["hash_config"], n_threads=o["n_threads"],
                                  profile_seconds=prof.get("seconds", 0.0), log=c.log)
        if o["profile_dir"] is None:
            shutil.rmtree(_profile_dir(c), ignore_errors=True)
    c.manifest.predictor = predictor_info(c.out)
    return result


def _sketch(c: Conversion, done: bool) -> None:
    """The exact-input scorer's low-bit gate/up rows (a layer already complete is kept, and a
    finished stage only gives its manifest entry again)."""
    from .sketch import write_sketches

    c.sketch_info = write_sketches(c.source, c.out, type_name=c.opts["sketch"], weight=c.params["sketch"]["weight"],
                                   progress=c.progress, block_freq=c.block_freq, block_abs_h=c.block_absh,
                                   down_norm=c.down_norm, n_threads=c.opts["n_threads"])
    c.manifest.sketch = c.sketch_info


def _vocab(c: Conversion, done: bool) -> None:
    """The rows the speculative draft's output projection computes, most used first."""
    if not done:
        (c.out / mf.DRAFT_DIR).mkdir(exist_ok=True)
        with atomic_writer(c.out / mf.DRAFT_VOCAB) as f:
            np.save(f, np.argsort(-c.acts.vocab, kind="stable").astype(np.int32), allow_pickle=False)
    c.manifest.extra["draft"] = {"vocab": mf.DRAFT_VOCAB}


def _calibrate(c: Conversion, done: bool) -> list:
    """What each sparsity costs on the corpus against the activations' references (the table
    quality="ppl+5%" reads; leanstream_convert/calibrate.py); the marker keeps the table."""
    from .calibrate import calibrate as run_calibration

    if done:
        quality = c.state.result("calibrate") or []
    else:
        c.manifest.record_checksums(c.out)
        quality = run_calibration(c.out, c.manifest, c.acts.references, memory_limit=c.limit,
                                  n_threads=c.opts["n_threads"], progress=c.progress, log=c.log)
    c.sketch_info.quality = quality
    return quality


def _routing(c: Conversion, done: bool) -> None:
    """A mixture-of-experts model's routing frequencies on the calibration corpus, through the
    plugin's MoE op under the limit (leanstream_convert/routing.py): experts/routing_freq.npy, the
    hot set's ranking."""
    from .calibrate import corpus
    from .routing import run_pass

    path = c.out / mf.ROUTING_FREQ
    if not done:
        try:
            freq = run_pass(c.out, c.manifest, corpus(c.opts["calibration"]), memory_limit=c.limit,
                            n_threads=c.opts["n_threads"], progress=c.progress)
        except ValueError as e:   # llama_cpp: "Failed to load model" (an architecture it cannot run)
            if "Failed to load model" not in str(e):
                raise
            c.log(f"no routing frequencies (the hot set stays empty): llama.cpp could not run {c.out / 'base.gguf'}: {e}")
            return
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.save(f, freq)
        os.replace(tmp, path)
    if path.exists():
        c.manifest.moe.routing_freq = mf.ROUTING_FREQ
    c.manifest.record_checksums(c.out)


def _write_manifest(c: Conversion, done: bool) -> None:
    """manifest.json, once, last: its presence marks a complete model directory; the state folder
    goes."""
    records = c.meter.records
    c.manifest.extra["conversion"] = {
        "memory_limit": c.limit, "memory_limit_source": c.limit_why, "stages": records,
        "seconds": round(sum(r["seconds"] for r in records.values()), 1),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in records.values())}
    fsync_dir(c.out)
    save_manifest(c.manifest, c.out)
    c.state.remove()


def _dense(c: Conversion) -> bool:
    return not c.moe


def _with_predictors(c: Conversion) -> bool:
    return _dense(c) and c.opts["predictors"] != "none"


def _with_sketch(c: Conversion) -> bool:
    return _dense(c) and c.opts["sketch"] != "none"


STAGES = (
    Stage("read", _read, "the source GGUF", "nothing: the source's sha256 and block geometry, in memory",
          marker=False),
    Stage("write", _write, "the source", "base.gguf, ffn/blk.<il>.bin in source order"),
    Stage("activations", _activations, "base.gguf, ffn/, the calibration corpus", ".convert/activations.npz",
          when=_dense),
    Stage("order", _order, ".convert/activations.npz, the source's down columns", ".convert/order.npz",
          when=lambda c: c.orders_neurons),
    Stage("reorder", _reorder, "ffn/, .convert/order.npz", "ffn/ in that order, in place",
          when=lambda c: c.orders_neurons),
    Stage("profile", _profile, "the source (stock llama.cpp), the calibration text",
          ".convert/profile/ (or --profile-dir)", when=_with_predictors),
    Stage("train", _train, "the profile", "predictor/", when=_with_predictors),
    Stage("sketch", _sketch, "the source's gate/up rows, the order's statistics", "sketch/", when=_with_sketch),
    Stage("vocab", _vocab, ".convert/activations.npz", "draft/vocab.npy", when=_dense),
    Stage("calibrate", _calibrate, "the model directory, the activations' references",
          "the manifest's quality table (opt-in)", when=lambda c: _with_sketch(c) and c.opts["calibrate"]),
    Stage("routing", _routing, "base.gguf, experts/, the calibration corpus", "experts/routing_freq.npy",
          when=lambda c: c.moe),
    Stage("manifest", _write_manifest, "every stage's outputs", "manifest.json", marker=False, timed=False),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


def stage_table() -> str:
    """The stages as lines of text: name, what it reads -> what it writes."""
    width = max(len(s.name) for s in STAGES)
    return "\n".join(f"    {s.name:<{width}}  {s.reads} -> {s.writes}" + ("" if s.marker else "  (no marker)")
                     for s in STAGES)


__doc__ = (__doc__ or "") + "\nThe stages (STAGES):\n\n" + stage_table() + "\n"


# ---- the driver ---------------------------------------------------------------------------------

def _run_stages(c: Conversion) -> mf.Manifest:
    for st in STAGES:
        if not st.when(c):
            continue
        done = st.marker and c.state.done(st.name)
        with c.meter.stage(st.name, done=done) if st.timed else contextlib.nullcontext():
            result = st.run(c, done)
        if st.marker and not done:
            c.state.mark(st.name, result)
        if st.name == "read":
            _after_read(c)
    return c.manifest


def _after_read(c: Conversion) -> None:
    """The read stage opened the conversion's state: from now on the meter keeps its records there
    (with those of the stages an interrupted run finished), and a resume says where it is."""
    c.meter = StageMeter(c.log, {**c.state.load_records(), **c.meter.records}, on_record=c.state.save_records)
    if c.resume and c.progress:
        finished = [s.name for s in STAGES if s.marker and c.state.done(s.name)]
        c.log(f"resuming an interrupted conversion of {c.source.path.name}"
              + (f" (finished: {', '.join(finished)})" if finished else ""))


def _settle_options(c: Conversion) -> None:
    """What the source allows of the options asked for (said, not refused), and the defaults that
    depend on the model (the activations pass's positions)."""
    o, model = c.opts, c.source.model
    if o["profile_tokens"] is None:   # (no activations pass on a MoE source)
        from .calibrate import corpus

        o["profile_tokens"] = MAX_TOKENS if c.moe else default_tokens(model.n_layer, model.n_embd, model.n_ff,
                                                                          len(corpus(o["calibration"])))
    if o["predictors"] != "none" and model.arch not in PREDICTOR_ARCHS:
        c.log(f"no predictors: the predictor stage supports {', '.join(PREDICTOR_ARCHS)}, not "
              f"{model.arch}, yet; {c.out} runs in dense mode")
        o["predictors"] = "none"
    if o["sketch"] != "none" and model.n_embd % 64:
        c.log(f"no sketch: the {o['sketch']} rows need n_embd a multiple of 64, the model "
              f"has {model.n_embd}; leanstream mode needs predictors here")
        o["sketch"] = "none"


def _parameters(c: Conversion) -> dict:
    """Every parameter the outputs depend on: a resumed conversion must have the same."""
    o, params = c.opts, c.source.params()
    if o["sketch"] != "none":
        from .sketch import DEFAULT_WEIGHT

        params["sketch"] = {"type": o["sketch"], "weight": DEFAULT_WEIGHT, "calibrate": bool(o["calibrate"]),
                            "calibration": _corpus_id(o["calibration"]) if o["calibrate"] else None}
    if o["predictors"] != "none":
        from .train.pipeline import training_settings

        params["predictors"] = training_settings(o["predictors"], hash_config=o["hash_config"],
                                                 profile_kwargs=o["profile_kwargs"],
                                                 calibration=_calibration_id(o["calibration"]))
    if c.orders_neurons:
        params["order"] = {"method": o["order"], "calibration": _corpus_id(o["calibration"])}
    params["activations"] = {"tokens": o["profile_tokens"], "calibration": _corpus_id(o["calibration"])}
    return params


def _profile_dir(c: Conversion) -> Path:
    return Path(c.opts["profile_dir"]) if c.opts["profile_dir"] else c.state.dir / "profile"


def _blocks_of_layer(source):
    """The block geometry the predictors are trained for: None (one neuron per block, file order
    = neuron order) or per layer (slots, k) with block b = neurons slots[b*k:(b+1)*k], -1 padding."""
    if source.k == 1 and all(np.array_equal(o, np.arange(len(o))) for o in source.orders):
        return None
    return [(source.slots(il), source.k) for il in range(source.model.n_layer)]


def _calibration_id(calibration) -> Any:
    if calibration is None:
        return None
    return {"file": Path(calibration).name, "sha256": sha256_file(calibration)}


def _corpus_id(calibration) -> dict:
    """The calibration corpus (bundled domains + the user's file) by content: a resumed
    conversion whose corpus changed starts its order and calibrate stages again."""
    from .calibrate import corpus

    return {name: sha256_file(p)[:16] for name, p in corpus(calibration).items()}


def _check_options(o: dict) -> None:
    from .sketch import TYPES as SKETCH_TYPES

    tokens = o["profile_tokens"]
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1):
        raise ConvertError(f"profile_tokens must be a positive integer, got {tokens!r}")
    if o["predictors"] not in PREDICTOR_CHOICES:
        raise ConvertError(f"predictors must be one of {', '.join(PREDICTOR_CHOICES)}, got {o['predictors']!r}")
    if o["order"] not in ORDER_METHODS:
        raise ConvertError(f"order must be one of {', '.join(ORDER_METHODS)}, got {o['order']!r}")
    if o["sketch"] != "none" and o["sketch"] not in SKETCH_TYPES:
        raise ConvertError(f"sketch must be one of {', '.join(SKETCH_TYPES)} or none, got {o['sketch']!r}")


def convert_model(src: str | os.PathLike, out_dir: str | os.PathLike, *, k: int = 1, align: int | None = None,
                  force: bool = False, progress: bool = True, permutation=None,
                  predictors: str = "none", sketch: str = DEFAULT_SKETCH, calibrate: bool = False,
                  profile_dir: str | os.PathLike | None = None, calibration=None,
                  hash_config: dict | None = None, profile_kwargs: dict | None = None, n_threads: int = 2,
                  order: str = DEFAULT_ORDER, log: Callable[..., None] | None = None,
                  down_type: str = DEFAULT_DOWN_TYPE, memory_limit: int | str | None = None,
                  profile_tokens: int | None = None) -> mf.Manifest:
    """Convert GGUF ``src`` into the model directory ``out_dir``; returns its Manifest. The
    defaults are `leanstream convert`'s (leanstream_convert/cli.py passes only what its user gives).

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
    memory cgroup allows this process, leanstream_convert/budget.py). profile_tokens: positions of the
    calibration corpus the activations stage runs the model on (more: steadier statistics,
    proportionally longer; default ``activations.default_tokens``: 4096 up to a 1.5B model, fewer
    in proportion above, at least one chunk of each domain). profile_dir: keep the predictors' profile there (reused if complete);
    by default it lives in OUT/.convert/ and is removed at the end.
    hash_config / profile_kwargs: override the training / profiling settings of the choice.
    order: on-disk neuron order, "importance" (default), "coact", "freq" or "none" (GGUF order;
    leanstream_convert/order.py); only with one neuron per block, no ``permutation`` and a sketch.
    Raises ConvertError.
    """
    opts = dict(k=k, align=align, force=force, progress=progress, permutation=permutation, predictors=predictors,
                sketch=sketch, calibrate=calibrate, profile_dir=profile_dir, calibration=calibration,
                hash_config=hash_config, profile_kwargs=profile_kwargs, n_threads=n_threads, order=order,
                down_type=down_type, profile_tokens=profile_tokens)
    _check_options(opts)
    log = log or (lambda *a: print(*a, file=sys.stderr))
    out = Path(out_dir)
    check_out_dir_apart(Path(src), out)
    if memory_limit is None:
        limit, limit_why = machine_limit()
    else:
        limit, limit_why = params_mod.size_bytes(memory_limit, "memory_limit"), "given"
    log(f"memory limit {limit / 1e6:.0f} MB ({limit_why})")     # the limit, before the first stage
    c = Conversion(src=Path(src), out=out, opts=opts, log=log, limit=limit, limit_why=limit_why, meter=StageMeter(log))
    try:
        return _run_stages(c)
    except OSError as e:
        remove_partials(out)
        if e.errno is None:   # numpy's tofile reports a short write without errno
            raise ConvertError(f"{out}: writing failed ({e}): the disk is full or a file size limit was "
                               f"reached; free some space or choose another output directory") from None
        raise
    except BaseException:
        remove_partials(out)
        raise
