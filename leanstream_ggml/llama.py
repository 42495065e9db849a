"""The drop-in ``Llama``: llama_cpp.Llama over a converted model directory.

Everything llama-cpp-python does (completion, chat with the GGUF's template, streaming,
tokenize, the server) works unchanged: the base model (every non-FFN tensor and all metadata)
is loaded by the patched libllama, and each layer's FFN is handed to libleanstream through the
per-context hook ``llama_set_ffn_builder``.
"""

from __future__ import annotations

import difflib
import gc
import inspect
import warnings
from pathlib import Path

import llama_cpp

from leanstream_ggml.llamacpp import _llama_cpp, context, stock
from leanstream_ggml import memplan, moe_model, options
from leanstream_ggml.model import registry
from leanstream_ggml.native import modes, params
from leanstream_ggml.model import manifest as manifest_mod
from leanstream_ggml.native.engine import EXACT_ROWS, FFNEngine
from leanstream_ggml.native.moe import MoEEngine


def _load_array(path: Path, valid, expected: str):
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


# passed by llama-cpp-python's own server loader, which its Llama takes through **kwargs and ignores
_PASSED_BY_LLAMA_CPP = ("rpc_servers", "mul_mat_q")


def _llama_cpp_keywords() -> list[str]:
    ps = inspect.signature(llama_cpp.Llama.__init__).parameters
    return [n for n, p in ps.items() if n not in ("self", "model_path") and p.kind is not p.VAR_KEYWORD] + \
        list(_PASSED_BY_LLAMA_CPP)


def _refuse_unknown_keywords(kwargs: dict) -> None:
    """llama_cpp.Llama takes **kwargs and drops what it does not know: a misspelt option (or one
    that does not exist, like memory_limt=) would run with its default unnoticed. A keyword that
    neither this class nor llama_cpp.Llama names is a TypeError naming it and the nearest one."""
    known = _llama_cpp_keywords()
    unknown = [k for k in kwargs if k not in known]
    if not unknown:
        return
    ours = [o.name for o in options.LLAMA]
    k = unknown[0]
    near = difflib.get_close_matches(k, ours + known, n=1, cutoff=0.5)
    raise TypeError(f"Llama() got an unexpected keyword argument {k!r}"
                    + (f"; did you mean {near[0]!r}?" if near else "")
                    + " (neither leanstream's options nor llama_cpp.Llama's take it)")


_GENERATE = inspect.signature(llama_cpp.Llama.generate)


def _plan(path: Path, m, o: dict, kwargs: dict, *, base=None, process=None,
          pass_: dict | None = None) -> memplan.MemoryPlan:
    """The memory plan of a Llama of these options (o: params.llama_options) and llama_cpp.Llama
    arguments under o["memory_limit"]: the logits of a verify pass's rows, or with logits_all of a
    batch's and n_ctx rows more; ``pass_``: Llama.converting's memory_pass."""
    n_ctx, n_batch = int(kwargs.get("n_ctx", 512)), int(kwargs.get("n_batch", 512))
    rows, of = (Llama._verify_rows_max(o), None) if o["speculative"] != "off" else (1, None)
    scores = 0
    if kwargs.get("logits_all"):
        scores = n_ctx if n_ctx > 0 else (base.n_ctx_train if base is not None and base.n_ctx_train else 0)
        rows, of = max(rows, min(n_batch, scores or n_batch)), "logits_all: every row of a batch"
    if pass_:
        rows, of = max(rows, pass_["rows"]), "a converter pass keeping every row's"
    return memplan.plan(path, m, o["memory_limit"], mode=o["mode"], n_ctx=n_ctx,
                        n_ubatch=min(n_batch, int(kwargs.get("n_ubatch", 512))), base=base, process=process,
                        n_outputs=rows, outputs_of=of, scores=scores, captures=(pass_ or {}).get("captures", 0))


# what gives way, in this order, where a limit leaves the engine less than its least cache and the
# caller left it to its default: a smaller batch (a long prompt takes more passes), a chain of
# drafts instead of a tree (fewer logit rows), no speculation
_FIT_BATCHES = (256, 128, 64)
# the default batch of a model that streams under its limit: its activations' memory goes to the
# FFN cache instead (Qwen2.5-Coder-1.5B: 36 MiB; plain decoding at 1000 MB, cold, 5.28-5.52 ->
# 5.69-5.95 tok/s). A prompt longer than this takes one more streamed pass per batch; a chat
# turn's new tokens usually fit in one.
STREAM_BATCH = 128


def _fit(path: Path, m, o: dict, given: dict, kwargs: dict, pass_: dict | None = None) -> memplan.MemoryPlan:
    """The plan under o["memory_limit"], with the defaults the caller did not set given way until it
    leaves the engine its least cache and memplan.FIT_SPARE more (memplan.fit), or nothing is left
    to give (``check`` refuses a plan short of the least); a model that streams under the limit
    takes STREAM_BATCH as its default batch. Changes kwargs (n_batch) and o
    (draft_width, speculative) in place; the plan's ``fitted`` says what changed."""
    base, process = memplan.read_base(m.resolve(path, m.base.file)), memplan.process_bytes()

    def plan_for(settings: dict) -> memplan.MemoryPlan:
        batch = {k: v for k, v in settings.items() if k == "n_batch"}
        return _plan(path, m, {**o, **{k: v for k, v in settings.items() if k not in batch}}, {**kwargs, **batch},
                     base=base, process=process, pass_=pass_)

    steps, start = [], {}
    if "n_batch" not in kwargs and "n_ubatch" not in kwargs:
        if plan_for({}).streams:
            start = {"n_batch": STREAM_BATCH}
        steps += [{"n_batch": n} for n in _FIT_BATCHES if n < start.get("n_batch", 512)]
    if o["speculative"] != "off" and "speculative" not in given and "draft_width" not in given:
        steps += [{"draft_width": 1}, {"speculative": "off"}]
    plan = memplan.fit(plan_for, steps, start)
    for k, v in plan.fitted.items():
        (kwargs if k == "n_batch" else o)[k] = v
    return plan


def memory_plan(model_path, memory_limit, **kwargs) -> memplan.MemoryPlan:
    """The memory plan ``Llama(model_path, memory_limit=memory_limit, **kwargs)`` would make (the
    same defaults: dense mode, speculation on, fitted to the limit the same way), without loading
    the model; ``.check()`` raises what that Llama would raise. ``manifest`` and ``memory_pass``
    as Llama.converting takes them (the converter's passes)."""
    m, pass_ = kwargs.pop("manifest", None), kwargs.pop("memory_pass", None)
    given = {o.name: kwargs.pop(o.name) for o in options.LLAMA if o.name in kwargs}
    given["memory_limit"] = memory_limit
    o = params.llama_options(given)
    path = Path(model_path)
    return _fit(path, m if m is not None else manifest_mod.load(path), o, given, kwargs, pass_)


class ClosedError(ValueError):
    """A method of a closed Llama was called."""


class Llama(llama_cpp.Llama):
    """llama_cpp.Llama whose FFN layers stream from a LeanStream model directory.

    Args:
        model_path: a directory written by ``leanstream convert``.
        {options}
        The options are declared once, in options.py (their flags are made from the same table).
        They are validated first (params.llama_options): a bad value raises ParameterError (a
        ValueError) naming it. Defaults (None) are the engine's own (ls_engine_params_init), so
        they are written once. Under memory_limit, ``self.memory_plan`` is the plan. With no
        limit and no budget (in_ram="auto"), ``backend`` is "stock" where the source GGUF runs on
        llama.cpp's own kernels (stock.py; ``engine`` is None, ``stats()`` says so), else
        "stream" (the op) and ``stock_reason`` says why. After close(), every method raises ClosedError.
        Every other argument is llama_cpp.Llama's, with the same meaning.
    """

    def __init__(self, model_path: str, **kwargs):
        self._engine = self._drafter = None
        self._closed = False
        # _manifest, _pass: Llama.converting's
        _manifest, _pass = kwargs.pop("_manifest", None), kwargs.pop("_pass", None)
        o, given, stock_kwargs = self._options(kwargs)
        self.memory_plan = None
        path = registry.converted_model_dir(str(model_path))
        self.manifest = _manifest if _manifest is not None else manifest_mod.load(path)
        self.model_dir = path
        m = self.manifest
        # nothing streams: the source GGUF on llama.cpp's own kernels where those are the faster
        # (stock.py); the converter's calibration (_manifest) always runs the op
        self.backend, self.source_path, self.stock_reason = "stream", None, "the converter's calibration"
        if _manifest is None:
            self.source_path, self.stock_reason = stock.choose(path, m, o, given)
        if self.source_path is not None:
            self.backend, self.mode, self.sparsity, self.speculative = "stock", o["mode"], 0.0, "off"
            self.controller_policy, self.hot_blocks = None, 0
            super().__init__(str(self.source_path), **stock_kwargs)
            return
        # every file the model is made of: inside the directory, regular, intact (block files
        # check their own tables when opened and each block when read)
        m.check_checksums(path)
        if m.moe is not None:
            moe_model.moe_options(o, given)     # (a mixture-of-experts model: docs/design.md §24)
        files = self._mode_files(path, o, model_path) if m.moe is None else None
        if o["memory_limit"]:
            self.memory_plan = _fit(path, m, o, given, kwargs, _pass)
            self.memory_plan.check()
            o["memory_budget"] = self.memory_plan.budget
        if m.moe is not None:
            self._engine, self.mode, self.sparsity, self.controller_policy, self.hot_blocks = \
                moe_model.open_engine(m, path, o), "dense", 0.0, None, 0
        else:
            self._open_engine(o, *files)
        self._open_context(path, kwargs, o)

    @staticmethod
    def _options(kwargs: dict) -> tuple[dict, dict, dict]:
        """(options, the options given, llama_cpp.Llama's arguments as given), every option checked
        before anything is opened (ParameterError names the bad one); kwargs keeps llama_cpp.Llama's."""
        given = {o.name: kwargs.pop(o.name) for o in options.LLAMA if o.name in kwargs}
        _refuse_unknown_keywords(kwargs)
        if kwargs.get("draft_model") is not None:
            given["speculative"] = "off"     # llama-cpp-python's own draft model proposes instead
        o = params.llama_options(given)
        stock_kwargs = dict(kwargs)   # llama_cpp.Llama's arguments as given (stock.py: in RAM)
        # a verify pass decodes several rows at once; llama.cpp's CPU backend computes a row of a
        # batch as that token alone (llama_set_exact_rows) with flash attention only, and plain
        # decoding must use the same attention for speculation to change no answer: flash
        # attention unless told otherwise (docs/design.md §21)
        kwargs.setdefault("flash_attn", True)
        return o, given, stock_kwargs

    def _mode_files(self, path: Path, o: dict, model_path) -> tuple:
        """(predictor paths, block ranking, sketch paths) the mode reads (None: none); a quality=
        target chosen as its sparsity (o["sparsity"])."""
        m, mode, quality = self.manifest, o["mode"], o["quality"]
        predictor_paths = block_rank = sketch_paths = None
        if modes.is_sparse(mode):
            # the files the mode reads, as the engine's mode table says (ManifestError/ValueError
            # naming what is missing)
            files = m.mode_files(path, modes.uses(mode), mode)
            predictor_paths = [m.resolve(path, f) for f in files.predictors] if files.predictors else None
            sketch_paths = [m.resolve(path, f) for f in files.sketches] if files.sketches else None
            if files.block_freq:
                block_rank = self._block_rank(path)
            if quality is not None:
                if not sketch_paths or not m.sketch.quality:
                    raise ValueError(f"quality={quality!r} needs the converter's calibration of {model_path} "
                                     f"(convert again with --calibrate), or give sparsity=")
                if not all(q.get("domains") for q in m.sketch.quality):
                    warnings.warn(f"{model_path}: quality= was calibrated on prose only (an older converter); on code "
                                  f"and chat it can cost more: convert again to calibrate every domain", stacklevel=3)
                o["sparsity"] = params.sparsity_for_quality(m.sketch.quality, params.quality(quality))
        elif m.block_importance_file() or m.block_freq_file():
            # dense mode pins each layer's most important blocks (not a prefix of the scan): the
            # speculative draft's FFN, and every layer keeps a streamed part, which the next
            # layer's prefetch reads while this one computes (a prefix of the scan leaves whole
            # layers to stream, too large to prefetch); by mean |h| x ||down|| where the converter
            # measured it, else by frequency. The same set with speculation on or off.
            block_rank = self._block_rank(path, m.block_importance_file())
        return predictor_paths, block_rank, sketch_paths

    def _open_engine(self, o: dict, predictor_paths, block_rank, sketch_paths) -> None:
        """The FFN engine over the block files, checked against the manifest, its controller set."""
        m, path, mode = self.manifest, self.model_dir, o["mode"]
        self._engine = FFNEngine([m.resolve(path, e.file) for e in m.layers], activation=m.activation,
                                 predictor_paths=predictor_paths, block_rank=block_rank, sketch_paths=sketch_paths,
                                 **{name: o[name] for name in options.ENGINE})
        self._check_layers_match_manifest()
        self.mode, self.sparsity = mode, self._engine.sparsity
        self.controller_policy = self._install_controller(o["controller"])
        # the calibration-hot blocks the engine keeps resident (powerinfer2, leanstream)
        self.hot_blocks = self._engine.stats()["hot_blocks"] if modes.is_sparse(mode) else 0

    def _open_context(self, path: Path, kwargs: dict, o: dict) -> None:
        """llama_cpp.Llama over base.gguf with the engine's hooks set, and the speculative drafter."""
        m, spec = self.manifest, o["speculative"]
        # one KV cache for the sequences of a token tree (speculative.py), in every mode, so that
        # plain decoding runs on the same context
        # (as many as a verify pass has rows, one without speculation: llama.cpp reserves and
        # clears n_seq_max rows of logits at load, 37 MiB at 64 rows of Qwen's 151,936, held
        # for good under a memory limit; and asserts they fit in n_batch's)
        self._n_seq = self._seq_max(kwargs, self._verify_rows_max(o) if spec != "off" else 1)
        with _llama_cpp.context_params(n_seq_max=self._n_seq, kv_unified=True):
            super().__init__(str(m.resolve(path, m.base.file)), **kwargs)
        if m.moe is not None:   # the routed experts (the router stays llama.cpp's)
            _llama_cpp.set_moe_builder(self, MoEEngine.builder_address(), self._engine.address)
        else:
            _llama_cpp.set_ffn_builder(self, FFNEngine.builder_address(), self._engine.address)
            # the output projection too (the same arithmetic; the draft computes its vocabulary's rows)
            _llama_cpp.set_output_builder(self, FFNEngine.output_builder_address(), self._engine.address)
        # a row of a batch of up to EXACT_ROWS tokens rounds as that token alone, in plain decoding
        # too: a verify pass then agrees with plain decoding bit for bit (docs/design.md §21)
        _llama_cpp.set_exact_rows(self, EXACT_ROWS)
        # the op's I/O errors surface as a Python exception right after the decode that hit them
        _llama_cpp.wrap_decode(self, self._engine.raise_pending)
        self.speculative = spec
        if spec != "off":
            from leanstream_ggml.speculation.speculative import Drafter

            self._drafter = Drafter(self, spec, o["draft_max"], o["draft_stop"], o["draft_fraction"],
                                    width=o["draft_width"], max_rows=min(self._verify_rows_max(o), self._n_seq),
                                    vocab=self._draft_vocab(),
                                    resident=self._resident_share() if m.moe is None else 1.0)

    @classmethod
    def converting(cls, model_path, manifest, memory_pass: dict | None = None, **kwargs) -> Llama:
        """A Llama over a directory the converter is still writing (its ``manifest`` as it stands),
        on the op; ``memory_pass`` ({"rows", "captures"}): what a converter pass holds besides,
        which the memory plan counts (``_plan``)."""
        return cls(model_path, _manifest=manifest, _pass=memory_pass, **kwargs)

    # the keywords, their types, defaults and help come from options.py (help(Llama) shows them)
    __init__.__signature__ = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         inspect.Parameter("model_path", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str),
         *options.parameters(), inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    __doc__ = __doc__.replace("        {options}\n", options.docstring(8) + "\n")

    def eval(self, tokens):
        """llama_cpp.Llama.eval; ``eval_all_rows`` keeps the logits of every row it decodes."""
        if self.__dict__.pop("_verify_rows", None) == len(tokens) and not _llama_cpp.logits_all(self):
            _llama_cpp.decode_all_rows(self, tokens)
        else:
            super().eval(tokens)

    def generate(self, tokens, *args, **kwargs):
        """llama_cpp.Llama.generate; with speculative decoding, its loop verifying a draft tree
        every pass (speculative.generate: the same prompt cache, sampler, stopping criteria and
        answers). With logits_all (logprobs) it decodes one token at a time."""
        # the sampler chains generations replaced (n_vocab x 12 bytes of candidates each) sit in a
        # reference cycle until a full collection: freed now (~10 ms), or the heap grows by one an
        # answer (Qwen: 1.7 MiB) for as long as Python's cyclic GC leaves them
        gc.collect()
        if self._drafter is None or _llama_cpp.logits_all(self):
            return super().generate(tokens, *args, **kwargs)
        from leanstream_ggml.speculation.speculative import generate

        a = _GENERATE.bind(self, tokens, *args, **kwargs)
        a.apply_defaults()
        kw = dict(a.arguments)
        del kw["self"], kw["tokens"]
        return generate(self, self._drafter, tokens, **kw)

    def _check_layers_match_manifest(self) -> None:
        """The block files' headers (checksummed) agree with what the manifest says of them."""
        for e in self.manifest.layers:
            info = self._engine.layer_info(e.il)
            have = (info["n_blocks"], info["block_stride"], info["block_payload"], info["data_offset"],
                    manifest_mod.GGML_TYPE_NAMES.get(info["gate_type"]), manifest_mod.GGML_TYPE_NAMES.get(info["up_type"]),
                    manifest_mod.GGML_TYPE_NAMES.get(info["down_type"]), info["n_embd"], info["n_ff"],
                    info["neurons_per_block"])
            want = (e.n_blocks, e.block_stride, e.block_payload, e.data_offset, e.gate_type, e.up_type, e.down_type,
                    self.manifest.n_embd, self.manifest.n_ff, self.manifest.block.k)
            if have != want:
                raise manifest_mod.ManifestError(
                    f"{self.model_dir / e.file}: its header does not match the manifest's layers[{e.il}] "
                    f"(file: {have}, manifest: {want}); re-run `leanstream convert` with --force")

    def _block_rank(self, path: Path, rel: str | None = None):
        """The calibration frequencies of every block (predictor/block_freq.npy, or without
        predictors the order stage's sketch/block_freq.npy: [n_layer, n_blocks] f32), checked, or
        None: the engine pins the best-ranked ones (the hot set of powerinfer2 and leanstream).
        The predictors' per-block prior is most of what they know (README: predictors), so the
        blocks a static hot set holds are hit by almost every token; without a hot set, a budget
        below one token's reads is a cyclic scan that LRU evicts just before reuse (measured: no
        cache hit at all on Qwen2.5-1.5B at 35 and 50 % budgets)."""
        import numpy as np

        m = self.manifest
        rel = rel or m.block_freq_file()
        if not rel:
            return None
        n_blocks = m.layers[0].n_blocks
        one_size = all(le.n_blocks == n_blocks for le in m.layers)
        return _load_array(
            m.resolve(path, rel),
            lambda a: (one_size and a.shape == (m.n_layer, n_blocks) and np.issubdtype(a.dtype, np.floating)
                       and bool(np.all(np.isfinite(a)))),
            f"block frequencies must be finite floats of shape [n_layer, n_blocks] = [{m.n_layer}, {n_blocks}]")

    def _resident_share(self) -> float:
        """The share of each layer's blocks dense mode keeps resident (its pinned set; 1: all)."""
        s = self._engine.stats()
        total = sum(e.n_blocks for e in self.manifest.layers)
        return min(1.0, s["hot_blocks"] / total) if s["hot_blocks"] else 1.0

    @staticmethod
    def _seq_max(kwargs: dict, rows: int) -> int:
        """The context's n_seq_max: the rows of a verify pass (``rows``), or fewer where a batch is
        smaller (llama_cpp.Llama takes n_batch = min(n_batch, n_ctx); n_ctx 0 is the model's own,
        at least any batch)."""
        n_batch, n_ctx = int(kwargs.get("n_batch", 512)), int(kwargs.get("n_ctx", 512))
        return max(1, min(rows, n_batch, n_ctx or n_batch))

    @staticmethod
    def _verify_rows_max(o: dict) -> int:
        """The most rows a verify pass decodes: the pending tokens and a tree of draft_max steps of
        the draft's best tokens (the memory plan counts their logits), options.VERIFY_ROWS at most."""
        return min(EXACT_ROWS, options.VERIFY_ROWS, 1 + o["draft_max"] * o["draft_width"])

    def _draft_vocab(self):
        """The draft's vocabulary: the first speculative.DRAFT_VOCAB tokens of the converter's
        ranking (draft/vocab.npy), checked; None where the directory has none (every token)."""
        import numpy as np

        from leanstream_ggml.speculation.speculative import DRAFT_VOCAB

        rel = self.manifest.draft_vocab_file()
        if not rel:
            return None
        n_vocab = self.n_vocab()
        ids = _load_array(
            self.manifest.resolve(self.model_dir, rel),
            lambda a: (a.ndim == 1 and np.issubdtype(a.dtype, np.integer) and len(a) > 0
                       and a.min() >= 0 and a.max() < n_vocab),
            f"the draft vocabulary must be token ids in [0, {n_vocab})")
        return ids[:DRAFT_VOCAB]

    def _install_controller(self, controller: str):
        """The tuned policy in force (None: off, or fixed on the default actions)."""
        if controller == "off":
            return None
        from leanstream_ggml.native import control

        policies = control.load_policies(self.model_dir, self.manifest)
        if controller == "table":
            pol = control.pick_policy(policies, self._engine.memory_budget, self.sparsity)
            self._engine.set_controller("table", actions=pol.actions, load_edges=pol.load_edges,
                                        disk_edges=pol.disk_edges, table=pol.table)
            return pol
        k = int(controller.split(":")[1])
        try:
            pol = control.pick_policy(policies, self._engine.memory_budget, self.sparsity)
        except control.ControllerError:
            pol = None
        actions = pol.actions if pol else list(control.DEFAULT_ACTIONS)
        if k >= len(actions):
            raise params.ParameterError("controller", f"fixed:{k}: there are {len(actions)} actions (0..{len(actions) - 1})")
        self._engine.set_controller("fixed", actions=actions, fixed_action=k)
        return pol

    @property
    def engine(self) -> FFNEngine | MoEEngine:
        """The FFN engine (a mixture-of-experts model's: its routed experts' engine)."""
        return self._engine

    def stats(self, layer: int | None = None) -> dict:
        """Engine counters (docs/design.md §5): blocks computed/read, bytes, miss ratio, stalls, ...
        (totals: summed over layers, except ``tokens``, the token rows the model processed);
        ``speculative``: passes, drafted and accepted tokens, tokens per pass (by tree shape),
        draft and verify seconds, the draft step's milliseconds. On the stock backend: only
        ``backend`` and ``source``."""
        if self.backend == "stock":
            if self._closed:
                raise ClosedError("this Llama is closed")
            return {"backend": "stock", "source": str(self.source_path)}
        s = self._live_engine().stats(layer)
        if self._drafter is not None:
            s["speculative"] = self._drafter.stats.as_dict()
        return s

    def reset_stats(self) -> None:
        if self.backend == "stock":
            return
        self._live_engine().reset_stats()
        if self._drafter is not None:
            from leanstream_ggml.speculation.speculative import SpecStats

            self._drafter.stats = SpecStats()

    def logits(self, i: int = -1):
        """f32 [n_vocab]: the logits of row i of the last decode (-1: the last row; without
        logits_all only the rows a batch asked for have them), a view valid until the next
        decode (``context.logits``)."""
        return context.logits(self, i)

    def eval_all_rows(self, tokens) -> None:
        """``eval(tokens)`` as a speculative verify pass runs it: the logits of every row are kept
        (``logits(i)``), without logits_all's n_ctx x n_vocab array (bench/speculative.py times it)."""
        self._verify_rows = len(tokens)
        self.eval(tokens)

    def draft_vocab(self):
        """The speculative draft's vocabulary now (int32 token ids, ascending: the converter's
        ranked tokens and the context's), or None: every token (no ranking, or no speculation)."""
        return None if self._drafter is None else self._drafter.vocab()

    def rewind(self, n_tokens: int) -> None:
        """Forget every position from ``n_tokens`` on (the tokens and the KV cache): what a
        rejected draft, or a timed pass, decoded past it."""
        self.n_tokens = n_tokens
        _llama_cpp.kv_cache_trim(self, n_tokens)

    def _live_engine(self) -> FFNEngine | MoEEngine:
        if self._engine is None:
            raise ClosedError("this Llama is closed")
        return self._engine

    def close(self) -> None:
        # the context (whose graphs point at the engine) goes first, then the engine; every
        # handle llama-cpp-python leaves behind raises ClosedError from now on
        _llama_cpp.close(self, ClosedError)
        _llama_cpp.close_batch(self)
        self._closed = True
        self._drafter = None
        if getattr(self, "_engine", None) is not None:
            self._engine.close()
            self._engine = None
