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
from pathlib import Path

import llama_cpp

from leanstream_ggml import backend, memplan, options
from leanstream_ggml.llamacpp import _llama_cpp, context
from leanstream_ggml.model import manifest as manifest_mod
from leanstream_ggml.model import registry
from leanstream_ggml.native import params
from leanstream_ggml.native.engine import EXACT_ROWS, FFNEngine
from leanstream_ggml.native.moe import MoEEngine
from leanstream_ggml.speculation import recurrent


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


def _plan(path: Path, m, o, kwargs: dict, *, base=None, process=None,
          pass_: dict | None = None) -> memplan.MemoryPlan:
    """The memory plan of a Llama of these settings (options.Settings) and llama_cpp.Llama
    arguments under o.memory_limit: the logits of a verify pass's rows, or with logits_all of a
    batch's and n_ctx rows more; ``pass_``: Llama.converting's memory_pass at its ``rows``."""
    n_ctx, n_batch = int(kwargs.get("n_ctx", 512)), int(kwargs.get("n_batch", 512))
    rows, of = (Llama._verify_rows_max(o), None) if o.speculative != "off" else (1, None)
    scores = 0
    if kwargs.get("logits_all"):
        scores = n_ctx if n_ctx > 0 else (base.n_ctx_train if base is not None and base.n_ctx_train else 0)
        rows, of = max(rows, min(n_batch, scores or n_batch)), "logits_all: every row of a batch"
    captures = 0
    if pass_:
        rows, of = max(rows, pass_["rows"]), "a converter pass keeping every row's"
        captures = pass_.get("captures_per_row", 0) * pass_["rows"]
    return memplan.plan(path, m, o.memory_limit, mode=o.mode, n_ctx=n_ctx,
                        n_ubatch=min(n_batch, int(kwargs.get("n_ubatch", 512))), base=base, process=process,
                        n_outputs=rows, outputs_of=of, scores=scores, captures=captures)


# what gives way, in this order, where a limit leaves the engine less than its least cache and the
# caller left it to its default: a smaller batch (a long prompt takes more passes), a chain of
# drafts instead of a tree (fewer logit rows), no speculation; a converter pass's rows per decode
# (halved down to its least)
_FIT_BATCHES = (256, 128, 64)


def _fit(path: Path, m, o, given: dict, kwargs: dict, pass_: dict | None = None,
         stream_batch: int | None = backend.STREAM_BATCH) -> memplan.MemoryPlan:
    """The plan under o.memory_limit, with the defaults the caller did not set given way until it
    leaves the engine its least cache and memplan.FIT_SPARE more (memplan.fit: the one fit), or
    nothing is left to give (``check`` refuses a plan short of the least); a model that streams
    under the limit takes ``stream_batch`` as its default batch (the backend's: None keeps
    llama-cpp-python's). The plan's ``fitted`` says what changed (``_fitted`` applies it)."""
    base, process = memplan.read_base(m.resolve(path, m.base.file)), memplan.process_bytes()

    def plan_for(settings: dict) -> memplan.MemoryPlan:
        s, kw, pas = dict(settings), dict(kwargs), pass_
        if "rows" in s:
            r = s.pop("rows")
            pas, kw["n_batch"], kw["n_ubatch"] = {**pass_, "rows": r}, r, r
        if "n_batch" in s:
            kw["n_batch"] = s.pop("n_batch")
        return _plan(path, m, o.replace(**s), kw, base=base, process=process, pass_=pas)

    steps, start = [], {}
    if "n_batch" not in kwargs and "n_ubatch" not in kwargs:
        if stream_batch and plan_for({}).streams:
            start = {"n_batch": stream_batch}
        steps += [{"n_batch": n} for n in _FIT_BATCHES if n < start.get("n_batch", 512)]
    if o.speculative != "off" and "speculative" not in given and "draft_width" not in given:
        steps += [{"draft_width": 1}, {"speculative": "off"}]
    if pass_:
        r = pass_["rows"] >> 1
        while r >= pass_.get("min_rows", pass_["rows"]):
            steps.append({"rows": r})
            r >>= 1
    return memplan.fit(plan_for, steps, start)


def _fitted(plan: memplan.MemoryPlan, o, kwargs: dict):
    """(settings, llama_cpp.Llama arguments) as the plan fitted them, its budget the engine's."""
    fitted = {k: v for k, v in plan.fitted.items() if k != "rows"}
    batch = {"n_batch": fitted.pop("n_batch")} if "n_batch" in fitted else {}
    return o.replace(memory_budget=plan.budget, **fitted), {**kwargs, **batch}


def _default_limit(path: Path, m, o, given: dict, kwargs: dict, stream_batch: int | None = backend.STREAM_BATCH):
    """The settings with neither a memory limit nor a budget given: the limit what the machine or
    its memory cgroup allows this process (memplan.machine_limit, as the converter's default),
    where the model does not fit in it whole; else as they were (nothing streams)."""
    limit, _ = memplan.machine_limit()
    if limit >= memplan.UNLIMITED:
        return o
    with_limit = o.replace(memory_limit=limit)
    return with_limit if _fit(path, m, with_limit, given, kwargs, stream_batch=stream_batch).streams else o


def memory_plan(model_path, memory_limit, **kwargs) -> memplan.MemoryPlan:
    """The memory plan ``Llama(model_path, memory_limit=memory_limit, **kwargs)`` would make (the
    same defaults: dense mode, speculation on, fitted to the limit the same way), without loading
    the model; ``.check()`` raises what that Llama would raise. ``manifest`` and ``memory_pass``
    as Llama.converting takes them (the converter's passes: ``{"rows", "min_rows",
    "captures_per_row"}``; the plan's ``fitted["rows"]`` is the most rows that fit)."""
    m, pass_ = kwargs.pop("manifest", None), kwargs.pop("memory_pass", None)
    given = {o.name: kwargs.pop(o.name) for o in options.LLAMA if o.name in kwargs}
    given["memory_limit"] = memory_limit
    o = params.llama_options(given)
    path = Path(model_path)
    m = m if m is not None else manifest_mod.load(path)
    o, _ = _settle_speculation(path, m, o, given)
    return _fit(path, m, o, given, kwargs, pass_, backend.streamed(path, m).stream_batch)


def _settle_speculation(path: Path, m, o, given: dict) -> tuple:
    """(settings, why speculation is off or None): off where the model keeps a recurrent state
    (speculation/recurrent.py: llama.cpp cannot drop a rejected draft from it), before the memory
    plan counts a verify pass's rows and the context gets a token tree's sequences; an explicit
    speculative='self' or 'ngram' there is a ParameterError (a ValueError) saying why."""
    if o.speculative == "off":
        return o, None
    try:
        why = recurrent.reason(m.resolve(path, m.base.file), m.architecture)
    except manifest_mod.ManifestError:     # (what opens base.gguf says what is wrong with it)
        why = None
    if why is None:
        return o, None
    if given.get("speculative") not in (None, "auto"):
        raise params.ParameterError("speculative", f"{given['speculative']!r} drafts, but {why.removeprefix('off: ')}; "
                                                   f"use speculative='auto' (which drafts nothing here) or 'off'")
    return o.replace(speculative="off"), why


class ClosedError(ValueError):
    """A method of a closed Llama was called."""


class Llama(llama_cpp.Llama):
    """llama_cpp.Llama whose FFN layers stream from a LeanStream model directory.

    Args:
        model_path: a directory written by ``leanstream convert``.
        {options}
        The options are declared once, in options.py (their flags are made from the same table).
        They are validated first (params.llama_options) into one immutable ``options.Settings``:
        a bad value raises ParameterError (a ValueError) naming it. Defaults (None) are the
        engine's own (ls_engine_params_init), so they are written once. With neither
        memory_limit nor memory_budget, the limit is what the machine or its memory cgroup allows
        where the model does not fit in it whole (memplan.machine_limit). Under a limit,
        ``self.memory_plan`` is the plan and ``self.settings`` what it decided. What runs is
        chosen once (backend.choose): ``backend`` is "stock" where nothing streams and the source
        GGUF runs on llama.cpp's own kernels (llamacpp/stock.py; ``engine`` is None, ``stats()``
        says so), else "stream" (the engine of the model's kind: neuron blocks or experts) and
        ``stock_reason`` says why. On a model with a recurrent state (Mamba, a hybrid such as
        Qwen3-Next or LFM2) speculation is off, ``speculative_reason`` and stats() say why
        (speculation/recurrent.py). After close(), every method raises ClosedError.
        Every other argument is llama_cpp.Llama's, with the same meaning.
    """

    def __init__(self, model_path: str, **kwargs):
        self._engine = self._drafter = None
        self._closed = False
        self.speculative_reason = None
        # _manifest, _pass: Llama.converting's
        _manifest, _pass = kwargs.pop("_manifest", None), kwargs.pop("_pass", None)
        o, given, llama_kwargs, stock_kwargs = self._options(kwargs)
        self.memory_plan = None
        path = registry.converted_model_dir(str(model_path))
        self.manifest = m = _manifest if _manifest is not None else manifest_mod.load(path)
        self.model_dir = path
        # what runs it, chosen here once: the engine of its kind (neuron blocks or experts), with
        # the settings that kind takes, or stock llama.cpp where nothing streams
        engine = backend.streamed(path, m)
        o, self.speculative_reason = _settle_speculation(path, m, o, given)
        o = engine.settle(o, given, model_path)
        if _manifest is None and not o.memory_limit and o.memory_budget is None:
            o = _default_limit(path, m, o, given, llama_kwargs, engine.stream_batch)
        self._backend = b = backend.choose(engine, o, given, converting=_manifest is not None)
        self.backend, self.source_path, self.stock_reason = b.name, b.source_path, b.stock_reason
        self.settings = o
        if b.name == "stock":
            self.mode, self.sparsity, self.speculative = o.mode, 0.0, "off"
            self.controller_policy, self.hot_blocks = None, 0
            super().__init__(str(self.source_path), **stock_kwargs)
            return
        # every file the model is made of: inside the directory, regular, intact (block files
        # check their own tables when opened and each block when read)
        m.check_checksums(path)
        if o.memory_limit:
            self.memory_plan = _fit(path, m, o, given, llama_kwargs, _pass, engine.stream_batch)
            self.memory_plan.check()
            o, llama_kwargs = _fitted(self.memory_plan, o, llama_kwargs)
        self.settings = o
        self._engine = b.open(o)
        self.mode, self.sparsity, self.controller_policy, self.hot_blocks = b.describe(self._engine, o)
        self._open_context(path, llama_kwargs, o)

    @staticmethod
    def _options(kwargs: dict) -> tuple:
        """(settings, the options given, llama_cpp.Llama's arguments as this class runs them, and
        as given), every option checked before anything is opened (ParameterError names the bad one)."""
        given = {o.name: kwargs.pop(o.name) for o in options.LLAMA if o.name in kwargs}
        _refuse_unknown_keywords(kwargs)
        if kwargs.get("draft_model") is not None:
            given["speculative"] = "off"     # llama-cpp-python's own draft model proposes instead
        o = params.llama_options(given)
        # a verify pass decodes several rows at once; llama.cpp's CPU backend computes a row of a
        # batch as that token alone (llama_set_exact_rows) with flash attention only, and plain
        # decoding must use the same attention for speculation to change no answer: flash
        # attention unless told otherwise (docs/design.md §21)
        return o, given, {"flash_attn": True, **kwargs}, dict(kwargs)

    def _open_context(self, path: Path, kwargs: dict, o) -> None:
        """llama_cpp.Llama over base.gguf with the engine's hooks set, and the speculative drafter."""
        m, spec = self.manifest, o.speculative
        # one KV cache for the sequences of a token tree (speculative.py), in every mode, so that
        # plain decoding runs on the same context
        # (as many as a verify pass has rows, one without speculation: llama.cpp reserves and
        # clears n_seq_max rows of logits at load, held for good under a memory limit; and
        # asserts they fit in n_batch's)
        self._n_seq = self._seq_max(kwargs, self._verify_rows_max(o) if spec != "off" else 1)
        with _llama_cpp.context_params(n_seq_max=self._n_seq, kv_unified=True):
            super().__init__(str(m.resolve(path, m.base.file)), **kwargs)
        self._backend.hook(self, self._engine)
        why = recurrent.loaded(self.model, self.metadata.get("general.architecture", "?")) if spec != "off" else None
        if why:     # llama.cpp's own answer, where the table read before loading missed the architecture
            spec, self.speculative_reason = "off", why
        self.speculative = spec
        if spec != "off":
            from leanstream_ggml.speculation.speculative import Drafter

            self._drafter = Drafter(self, spec, o.draft_max, o.draft_stop, o.draft_fraction,
                                    width=o.draft_width, max_rows=min(self._verify_rows_max(o), self._n_seq),
                                    vocab=self._draft_vocab(), resident=self._backend.resident_share(self._engine))

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

    @staticmethod
    def _seq_max(kwargs: dict, rows: int) -> int:
        """The context's n_seq_max: the rows of a verify pass (``rows``), or fewer where a batch is
        smaller (llama_cpp.Llama takes n_batch = min(n_batch, n_ctx); n_ctx 0 is the model's own,
        at least any batch)."""
        n_batch, n_ctx = int(kwargs.get("n_batch", 512)), int(kwargs.get("n_ctx", 512))
        return max(1, min(rows, n_batch, n_ctx or n_batch))

    @staticmethod
    def _verify_rows_max(o) -> int:
        """The most rows a verify pass decodes: the pending tokens and a tree of draft_max steps of
        the draft's best tokens (the memory plan counts their logits), options.VERIFY_ROWS at most."""
        return min(EXACT_ROWS, options.VERIFY_ROWS, 1 + o.draft_max * o.draft_width)

    def _draft_vocab(self):
        """The draft's vocabulary: the first speculative.DRAFT_VOCAB tokens of the converter's
        ranking (draft/vocab.npy), checked; None where the directory has none (every token)."""
        import numpy as np

        from leanstream_ggml.speculation.speculative import DRAFT_VOCAB

        rel = self.manifest.draft_vocab_file()
        if not rel:
            return None
        n_vocab = self.n_vocab()
        ids = backend.load_array(
            self.manifest.resolve(self.model_dir, rel),
            lambda a: (a.ndim == 1 and np.issubdtype(a.dtype, np.integer) and len(a) > 0
                       and a.min() >= 0 and a.max() < n_vocab),
            f"the draft vocabulary must be token ids in [0, {n_vocab})")
        return ids[:DRAFT_VOCAB]

    @property
    def engine(self) -> FFNEngine | MoEEngine:
        """The FFN engine (a mixture-of-experts model's: its routed experts' engine)."""
        return self._engine

    def stats(self, layer: int | None = None) -> dict:
        """Engine counters (docs/design.md §5): blocks computed/read, bytes, miss ratio, stalls, ...
        (totals: summed over layers, except ``tokens``, the token rows the model processed);
        ``speculative``: passes, drafted and accepted tokens, tokens per pass (by tree shape),
        draft and verify seconds, the draft step's milliseconds; ``speculative_reason``: why
        speculation is off, where the model keeps it off. On the stock backend: only ``backend``
        and ``source``."""
        if self.backend == "stock":
            if self._closed:
                raise ClosedError("this Llama is closed")
            return {"backend": "stock", "source": str(self.source_path)}
        s = self._live_engine().stats(layer)
        if self._drafter is not None:
            s["speculative"] = self._drafter.stats.as_dict()
        if self.speculative_reason:
            s["speculative_reason"] = self.speculative_reason
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
