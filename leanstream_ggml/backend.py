"""What runs a ``Llama``, chosen once (``choose``) from the manifest and the options.

- ``Stock``: nothing streams; the GGUF the directory was converted from runs on llama.cpp's own
  kernels (llamacpp/stock.py: in RAM, where those are the faster).
- ``Neurons``: a dense model's FFN as neuron blocks read from the block files into the engine's
  cache (native/engine.py, native/src/op.c); every mode, the sketch and predictors, the
  controller, the self draft.
- ``Experts``: a mixture-of-experts model's routed experts read from the expert files (native/moe.py,
  native/src/moe.c); llama.cpp computes everything else of base.gguf as stock does, the router
  included (its logits, softmax or sigmoid, top-k, the weights' normalization) and a shared expert
  with its gate (docs/design.md §24). The sparsity is the router's own, so there is one mode, dense
  (every expert a token is routed to, exactly), and the options that shape sparse decoding do not apply.

A streaming backend settles the options it takes (``settle``: a checked copy, never a change in
place), opens its engine over the directory's files (``open``) and hands it to the llama.cpp
context (``hook``). ``Llama`` asks it, never the manifest, what kind of model it runs.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from leanstream_ggml import options
from leanstream_ggml.llamacpp import _llama_cpp, stock
from leanstream_ggml.model import manifest as manifest_mod
from leanstream_ggml.native import modes, params
from leanstream_ggml.native.engine import FFNEngine
from leanstream_ggml.native.moe import MOE_HOT_FRACTION, MOE_PRIOR_TOKENS, MoEEngine


# the default batch of a dense model that streams under its limit: its activations' memory goes to
# the FFN cache instead (bench/results: plain decoding at 1000 MB). A prompt longer than this takes
# one more streamed pass per batch; a chat turn's new tokens usually fit in one.
STREAM_BATCH = 128


def streamed(path: Path, m):
    """The engine a model directory streams through: Experts for a mixture-of-experts model, else
    Neurons (the one place the kind of model is asked)."""
    return (Experts if m.moe is not None else Neurons)(path, m)


def choose(engine, o, given: dict, converting: bool):
    """What runs a Llama with settings ``o`` (the streamed engine's settled ones): Stock where
    nothing streams and llama.cpp's kernels are the faster (never for the converter's passes,
    ``converting``), else ``engine`` (its ``stock_reason`` says why)."""
    if converting:
        engine.stock_reason = "the converter's calibration"
        return engine
    source, engine.stock_reason = stock.choose(engine.path, engine.manifest, o, given)
    return Stock(engine.path, engine.manifest, source) if source is not None else engine


class Stock:
    """The source GGUF on llama.cpp; no engine."""

    name = "stock"

    def __init__(self, path: Path, m, source: Path):
        self.path, self.manifest, self.source_path, self.stock_reason = path, m, source, ""


class _Streamed:
    name = "stream"
    source_path = None

    def __init__(self, path: Path, m):
        self.path, self.manifest, self.stock_reason = path, m, ""

    def hook_common(self, llm, engine) -> None:
        # a row of a batch of up to EXACT_ROWS tokens rounds as that token alone, in plain decoding
        # too: a verify pass then agrees with plain decoding bit for bit (docs/design.md §21)
        from leanstream_ggml.native.engine import EXACT_ROWS

        _llama_cpp.set_exact_rows(llm, EXACT_ROWS)
        # the op's I/O errors surface as a Python exception right after the decode that hit them
        _llama_cpp.wrap_decode(llm, engine.raise_pending)



class Experts(_Streamed):
    """A mixture-of-experts model's routed experts through MoEEngine."""

    kind = "experts"
    # a prompt's batch reads each expert it routes to once: llama-cpp-python's default batch (512)
    # under a limit too, where it fits (the plan's fit gives way to smaller ones)
    stream_batch = None
    # prompt lookup (its drafts cost nothing; the verify pass reads the union of its rows' experts
    # once). The self draft from resident experts is not built yet.
    SPECULATION = ("auto", "ngram", "off")

    def settle(self, o, given: dict, model_path):
        """The settings a MoE model runs with (ValueError naming an option it does not take)."""
        if modes.is_sparse(o.mode):
            raise ValueError(f"mode={o.mode!r}: a mixture-of-experts model runs in dense mode (a token reads "
                             f"only the experts its router picks: the sparsity is exact already)")
        if o.speculative not in self.SPECULATION:
            raise ValueError(f"speculative={o.speculative!r}: on a mixture-of-experts model speculation drafts by "
                             f"prompt lookup (speculative='ngram', what 'auto' runs) or is off")
        if given.get("controller") not in (None, "off"):
            raise ValueError("controller: the streaming controller steers the dense FFN's reads; a "
                             "mixture-of-experts model reads whole experts")
        return o.replace(speculative="ngram") if o.speculative == "auto" else o

    def open(self, o) -> MoEEngine:
        """The routed experts' engine, its cache the budget (the plan's or the user's; 0: every
        expert once read), its hot set pinned (pin_hot)."""
        m = self.manifest
        engine = MoEEngine([None if e is None else m.resolve(self.path, e.file) for e in m.moe.layers],
                           memory_budget=o.memory_budget or 0, activation=m.moe.activation,
                           weight_before=m.moe.weight_before, n_io_threads=o.n_io_threads,
                           verify_checksums=o.verify_checksums, read_ahead=o.read_ahead, evict=o.expert_cache)
        try:
            freq = self.routing_freq()
            if freq is not None:
                for il, _ in m.moe.expert_layers():
                    engine.set_uses(il, np.rint(freq[il] * MOE_PRIOR_TOKENS))
            self.pin_hot(engine, freq, MOE_HOT_FRACTION if o.hot_fraction is None else o.hot_fraction)
        except BaseException:
            engine.close()
            raise
        return engine

    def routing_freq(self):
        """The conversion's routing frequencies (experts/routing_freq.npy, [n_layer, n_expert]),
        checked, or None (an older conversion)."""
        m = self.manifest
        if not m.moe.routing_freq:
            return None
        return load_array(m.resolve(self.path, m.moe.routing_freq),
                          lambda a: (a.shape == (m.n_layer, m.moe.n_expert) and np.issubdtype(a.dtype, np.floating)
                                     and bool(np.all(np.isfinite(a))) and bool(np.all(a >= 0))),
                          f"routing frequencies must be finite floats >= 0 of shape [n_layer, n_expert] = "
                          f"[{m.n_layer}, {m.moe.n_expert}]")

    def pin_hot(self, engine, freq, share: float) -> int:
        """Where the cache holds fewer experts than the model has: the (layer, expert) pairs the
        conversion's routing pass saw routed to most often (``freq``), ``share`` of the cache's
        slots (leaving at least 2 per MoE layer to stream the others through), pinned and read
        now. Returns how many (0: no frequencies, or every expert fits)."""
        m = self.manifest
        s = engine.stats()
        slots, total = s["cache_slots"], m.n_layer * m.moe.n_expert
        if freq is None or slots >= total or share <= 0:
            return 0
        n_hot = max(0, min(int(share * slots), slots - 2 * len(m.moe.expert_layers()), int(np.count_nonzero(freq > 0))))
        hot = np.argsort(-freq.reshape(-1), kind="stable")[:n_hot]
        for il, _ in m.moe.expert_layers():
            mine = hot[hot // m.moe.n_expert == il] % m.moe.n_expert
            if mine.size:
                engine.pin(il, mine)
        return n_hot

    def describe(self, engine, o) -> tuple:
        """(mode, sparsity, controller policy, hot blocks) as Llama reports them."""
        return "dense", 0.0, None, engine.stats()["pinned"]

    def hook(self, llm, engine) -> None:
        _llama_cpp.set_moe_builder(llm, MoEEngine.builder_address(), engine.address)
        self.hook_common(llm, engine)

    def resident_share(self, engine) -> float:
        return 1.0


class Neurons(_Streamed):
    """A dense model's FFN as neuron blocks through FFNEngine."""

    kind = "neurons"
    stream_batch = STREAM_BATCH

    def settle(self, o, given: dict, model_path):
        """The settings this directory runs with: a quality= target becomes its sparsity; the
        files the mode reads are found (ManifestError/ValueError naming what is missing)."""
        m, mode = self.manifest, o.mode
        if given.get("read_ahead") not in (None, "off") or given.get("expert_cache") not in (None, "lfu"):
            raise ValueError("read_ahead, expert_cache: a mixture-of-experts model's; a dense model's blocks are "
                             "prefetched and kept by its mode's own schedule")
        self.predictor_paths = self.sketch_paths = None
        self.rank_file = False     # the block ranking the engine pins by (open loads it): None, the default's
        if modes.is_sparse(mode):
            files = m.mode_files(self.path, modes.uses(mode), mode)
            self.predictor_paths = [m.resolve(self.path, f) for f in files.predictors] if files.predictors else None
            self.sketch_paths = [m.resolve(self.path, f) for f in files.sketches] if files.sketches else None
            if files.block_freq:
                self.rank_file = None
            if o.quality is not None:
                return o.replace(sparsity=self._quality_sparsity(o.quality, model_path))
        elif m.block_importance_file() or m.block_freq_file():
            # dense mode pins each layer's most important blocks (not a prefix of the scan): the
            # speculative draft's FFN, and every layer keeps a streamed part, which the next
            # layer's prefetch reads while this one computes (a prefix of the scan leaves whole
            # layers to stream, too large to prefetch); by mean |h| x ||down|| where the converter
            # measured it, else by frequency. The same set with speculation on or off.
            self.rank_file = m.block_importance_file()
        return o

    def _quality_sparsity(self, quality, model_path) -> float:
        m = self.manifest
        if not self.sketch_paths or not m.sketch.quality:
            raise ValueError(f"quality={quality!r} needs the converter's calibration of {model_path} "
                             f"(convert again with --calibrate), or give sparsity=")
        if not all(q.get("domains") for q in m.sketch.quality):
            warnings.warn(f"{model_path}: quality= was calibrated on prose only (an older converter); on code "
                          f"and chat it can cost more: convert again to calibrate every domain", stacklevel=4)
        return params.sparsity_for_quality(m.sketch.quality, params.quality(quality))

    def open(self, o) -> FFNEngine:
        """The FFN engine over the block files, checked against the manifest."""
        m = self.manifest
        block_rank = self._block_rank(self.rank_file) if self.rank_file is not False else None
        engine = FFNEngine([m.resolve(self.path, e.file) for e in m.layers], activation=m.activation,
                           predictor_paths=self.predictor_paths, block_rank=block_rank,
                           sketch_paths=self.sketch_paths, **{name: o[name] for name in options.ENGINE})
        try:
            self._check_layers_match_manifest(engine)
        except BaseException:
            engine.close()
            raise
        return engine

    def describe(self, engine, o) -> tuple:
        """(mode, sparsity, controller policy, hot blocks): the calibration-hot blocks the engine
        keeps resident in powerinfer2 and leanstream mode; the tuned policy in force."""
        policy = self._install_controller(engine, o.controller, engine.sparsity)
        hot = engine.stats()["hot_blocks"] if modes.is_sparse(o.mode) else 0
        return o.mode, engine.sparsity, policy, hot

    def hook(self, llm, engine) -> None:
        _llama_cpp.set_ffn_builder(llm, FFNEngine.builder_address(), engine.address)
        # the output projection too (the same arithmetic; the draft computes its vocabulary's rows)
        _llama_cpp.set_output_builder(llm, FFNEngine.output_builder_address(), engine.address)
        self.hook_common(llm, engine)

    def resident_share(self, engine) -> float:
        """The share of each layer's blocks dense mode keeps resident (its pinned set; 1: all)."""
        s = engine.stats()
        total = sum(e.n_blocks for e in self.manifest.layers)
        return min(1.0, s["hot_blocks"] / total) if s["hot_blocks"] else 1.0

    def _check_layers_match_manifest(self, engine) -> None:
        """The block files' headers (checksummed) agree with what the manifest says of them."""
        m = self.manifest
        names = manifest_mod.GGML_TYPE_NAMES
        for e in m.layers:
            info = engine.layer_info(e.il)
            have = (info["n_blocks"], info["block_stride"], info["block_payload"], info["data_offset"],
                    names.get(info["gate_type"]), names.get(info["up_type"]), names.get(info["down_type"]),
                    info["n_embd"], info["n_ff"], info["neurons_per_block"])
            want = (e.n_blocks, e.block_stride, e.block_payload, e.data_offset, e.gate_type, e.up_type, e.down_type,
                    m.n_embd, m.n_ff, m.block.k)
            if have != want:
                raise manifest_mod.ManifestError(
                    f"{self.path / e.file}: its header does not match the manifest's layers[{e.il}] "
                    f"(file: {have}, manifest: {want}); re-run `leanstream convert` with --force")

    def _block_rank(self, rel: str | None = None):
        """The calibration frequencies of every block (predictor/block_freq.npy, or without
        predictors the order stage's sketch/block_freq.npy: [n_layer, n_blocks] f32), checked, or
        None: the engine pins the best-ranked ones (the hot set of powerinfer2 and leanstream).
        The predictors' per-block prior is most of what they know, so the blocks a static hot set
        holds are hit by almost every token; without a hot set, a budget below one token's reads
        is a cyclic scan that LRU evicts just before reuse (docs/design.md)."""
        import numpy as np

        m = self.manifest
        rel = rel or m.block_freq_file()
        if not rel:
            return None
        n_blocks = m.layers[0].n_blocks
        one_size = all(le.n_blocks == n_blocks for le in m.layers)
        return load_array(
            m.resolve(self.path, rel),
            lambda a: (one_size and a.shape == (m.n_layer, n_blocks) and np.issubdtype(a.dtype, np.floating)
                       and bool(np.all(np.isfinite(a)))),
            f"block frequencies must be finite floats of shape [n_layer, n_blocks] = [{m.n_layer}, {n_blocks}]")

    def _install_controller(self, engine, controller: str, sparsity: float):
        """The tuned policy in force (None: off, or fixed on the default actions)."""
        if controller == "off":
            return None
        from leanstream_ggml.native import control

        policies = control.load_policies(self.path, self.manifest)
        if controller == "table":
            pol = control.pick_policy(policies, engine.memory_budget, sparsity)
            engine.set_controller("table", actions=pol.actions, load_edges=pol.load_edges,
                                  disk_edges=pol.disk_edges, table=pol.table)
            return pol
        k = int(controller.split(":")[1])
        try:
            pol = control.pick_policy(policies, engine.memory_budget, sparsity)
        except control.ControllerError:
            pol = None
        actions = pol.actions if pol else list(control.DEFAULT_ACTIONS)
        if k >= len(actions):
            raise params.ParameterError("controller", f"fixed:{k}: there are {len(actions)} actions (0..{len(actions) - 1})")
        engine.set_controller("fixed", actions=actions, fixed_action=k)
        return pol


def load_array(path: Path, valid, expected: str):
    """The array of a .npy file of the model directory (no pickles), or ManifestError naming the
    file: unreadable, or not what ``valid(array)`` accepts (``expected`` says what it must be)."""
    import numpy as np

    try:
        a = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise manifest_mod.ManifestError(f"{path}: not a readable .npy array ({e})") from None
    if not isinstance(a, np.ndarray) or not valid(a):
        raise manifest_mod.ManifestError(f"{path}: {expected}, "
                                         f"got {getattr(a, 'dtype', '?')} {getattr(a, 'shape', '?')}")
    return a
