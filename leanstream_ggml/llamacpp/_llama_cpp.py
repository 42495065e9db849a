"""llama-cpp-python's internals, in one place.

``leanstream_ggml.Llama`` is a ``llama_cpp.Llama``; what it cannot do through llama-cpp-python's
public API (its Llama's methods, the C bindings of ``llama_cpp.llama_cpp``) it does here, and
nowhere else:

- ``set_ffn_builder``, ``set_output_builder``, ``set_moe_builder``: libllama's added functions
  (patches/0001, 0004, 0005), bound on llama-cpp-python's own ctypes handle of libllama;
- ``wrap_decode``: the context's decode followed by a check, so that an error of the FFN op's
  I/O workers raises right after the decode that hit it;
- ``decode``: the one batch decoder outside ``Llama.eval``: rows with a position and sequence ids
  each, the logits of every row or of the last (a token tree's verify pass, the self draft's
  steps, ``decode_all_rows``: eval with every row's logits without logits_all's n_ctx x n_vocab
  array); ``kv_cache_trim``: what the draft decoded, dropped;
- ``close``: llama_cpp.Llama.close leaves its native handles behind as attributes; they are
  replaced by stand-ins that raise, so a closed Llama never touches freed memory;
- ``create_server_app``: llama-cpp-python's server, its model loaded by its own loader with another
  Llama class (two module globals of its server swapped for the duration of one call).

What a tool may read of any llama_cpp.Llama (stock or ours) is in context.py, through their
public API. This module is written against the llama-cpp-python the build vendors (``PINNED``, build.py), and
tests/unit/test_llama_cpp_pin.py fails, naming what to re-check, when the installed one is another or
a private name listed in ``RELIES_ON`` / ``LLAMA_ATTRS`` is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import llama_cpp

from leanstream_ggml.build import LLAMA_CPP_PYTHON_VERSION as PINNED  # noqa: F401  (tests/unit/test_llama_cpp_pin.py reads it)

# every private name of llama-cpp-python used below: (where, name, what uses it)
RELIES_ON = (
    ("llama_cpp.llama_cpp", "_lib", "set_ffn_builder, has_ffn_builder: libllama's ctypes handle"),
    ("llama_cpp._internals.LlamaContext", "decode", "wrap_decode, decode"),
    ("llama_cpp._internals.LlamaContext", "kv_cache_seq_rm", "decode_all_rows, kv_cache_trim"),
    ("llama_cpp._internals.LlamaBatch", "close", "Batch.close"),
    ("llama_cpp._internals.LlamaBatch", "batch", "Batch.decode: the llama_batch it fills"),
    ("llama_cpp._internals.LlamaSampler", "sample", "sampler: the tree walk samples a batch row"),
    ("llama_cpp.Llama", "_init_sampler", "sampler: the user's sampling arguments as generate builds them"),
    ("llama_cpp.llama", "llama_cpp", "context_params: Llama.__init__ calls its llama_context_default_params()"),
    ("llama_cpp.server.model", "llama_cpp", "create_server_app: the loader's module global, swapped while it loads"),
    ("llama_cpp.server.model.LlamaProxy", "load_llama_from_model_settings", "create_server_app: their loader"),
    ("llama_cpp.server.model.LlamaProxy", "_current_model", "create_server_app's current(): the loaded model"),
    ("llama_cpp.server.app", "LlamaProxy", "create_server_app: create_app's module global, swapped while it runs"),
)
# llama_cpp.Llama's instance attributes used here (its __init__ sets them; eval updates the last
# three as decode_all_rows does); HANDLE_ATTRS hold native handles
HANDLE_ATTRS = ("_model", "_ctx", "_batch", "_sampler", "tokenizer_", "_candidates")
LLAMA_ATTRS = HANDLE_ATTRS + ("_stack", "_logits_all", "input_ids", "n_tokens", "_requires_eval", "_mirostat_mu", "scores")

_lib = llama_cpp.llama_cpp._lib   # ctypes.CDLL of the libllama llama-cpp-python loaded


# ---- libllama's added function --------------------------------------------------------------------

def has_ffn_builder() -> bool:
    """Whether the installed libllama is the patched one (it has ``llama_set_ffn_builder``)."""
    return hasattr(_lib, "llama_set_ffn_builder")


@functools.cache
def _ffn_builder_fn():
    if not has_ffn_builder():
        raise RuntimeError(f"{_lib._name}: this libllama has no llama_set_ffn_builder, so it is not the patched "
                           f"build; install it with `python -m leanstream_ggml.build`")
    f = _lib.llama_set_ffn_builder
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    f.restype = None
    return f


def set_ffn_builder(llm: llama_cpp.Llama, builder: int, user_data: int) -> None:
    """``llama_set_ffn_builder(ctx, builder, user_data)`` on llm's context: every layer's FFN of
    its graphs is built by ``builder`` (addresses of C objects)."""
    _ffn_builder_fn()(llm.ctx, builder, user_data)


@functools.cache
def _builder_setter(name: str):
    """One of the patched build's ``llama_set_*_builder(ctx, builder, user_data)``."""
    _ffn_builder_fn()   # (the same patched build)
    f = getattr(_lib, name)
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    f.restype = None
    return f


def set_output_builder(llm: llama_cpp.Llama, builder: int, user_data: int) -> None:
    """``llama_set_output_builder(ctx, builder, user_data)`` (patches/0004): the output projection
    of llm's graphs is built by ``builder``."""
    _builder_setter("llama_set_output_builder")(llm.ctx, builder, user_data)


def set_moe_builder(llm: llama_cpp.Llama, builder: int, user_data: int) -> None:
    """``llama_set_moe_builder(ctx, builder, user_data)`` (patches/0005): the routed experts of
    every mixture-of-experts layer of llm's graphs are built by ``builder`` (the router stays
    llama.cpp's)."""
    _builder_setter("llama_set_moe_builder")(llm.ctx, builder, user_data)


@functools.cache
def _exact_rows_fn():
    _ffn_builder_fn()   # (the same patched build)
    f = _lib.llama_set_exact_rows
    f.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    f.restype = ctypes.c_bool
    return f


def set_exact_rows(llm: llama_cpp.Llama, n_rows: int) -> None:
    """``llama_set_exact_rows(ctx, n_rows)``: batches of up to n_rows tokens compute every row as
    decoding that token alone would (patches/0003), so a verify pass rounds as plain decoding."""
    if not _exact_rows_fn()(llm.ctx, n_rows):
        raise RuntimeError("llama_set_exact_rows: no CPU backend in this context took it")


# ---- decoding ------------------------------------------------------------------------------------

def wrap_decode(llm: llama_cpp.Llama, after) -> None:
    """Every decode on llm's context (eval's, generate's, a draft's) calls ``after()`` once it
    returns (the engine raises an I/O error its workers kept)."""
    ctx = llm._ctx
    decode = ctx.decode

    def checked(batch):
        decode(batch)
        after()

    ctx.decode = checked


def logits_all(llm: llama_cpp.Llama) -> bool:
    """Whether llm keeps every row's logits (``logits_all=True``: eval fills ``scores``)."""
    return llm._logits_all


class Batch:
    """A llama_batch of up to n_tokens rows, each with a position and up to n_seq_max sequence
    ids, decoded on a Llama's context outside its eval. Owns its llama_batch: close()."""

    def __init__(self, n_tokens: int, n_seq_max: int):
        self.n_tokens, self.n_seq_max = n_tokens, n_seq_max
        self._batch = llama_cpp._internals.LlamaBatch(n_tokens=n_tokens, embd=0, n_seq_max=n_seq_max, verbose=False)

    def decode(self, llm: llama_cpp.Llama, tokens, positions, seqs=None, all_rows: bool = True) -> None:
        """Row i: tokens[i] at positions[i] in the sequences seqs[i] (the masking one first; seqs
        None: sequence 0 only); the logits of every row kept, or of the last only."""
        b = self._batch.batch
        b.n_tokens = len(tokens)
        for i, (t, p) in enumerate(zip(tokens, positions)):
            b.token[i] = t
            b.pos[i] = p
            ss = (0,) if seqs is None else seqs[i]
            b.n_seq_id[i] = len(ss)
            for k, s in enumerate(ss):
                b.seq_id[i][k] = s
            b.logits[i] = all_rows
        b.logits[len(tokens) - 1] = True
        llm._ctx.decode(self._batch)

    def close(self) -> None:
        self._batch.close()


def decode(llm: llama_cpp.Llama, tokens, positions, seqs=None, all_rows: bool = True) -> None:
    """``Batch.decode`` on llm's batch (one per Llama, grown to fit: n_seq_max sequence ids of a
    token tree for at least 64 rows; ``close_batch`` frees it)."""
    n_seq = 1 if seqs is None else max(len(ss) for ss in seqs)
    b = llm.__dict__.get("_ls_batch")
    if b is None or b.n_tokens < len(tokens) or b.n_seq_max < n_seq:
        if b is not None:
            b.close()
        b = llm._ls_batch = Batch(max(len(tokens), 64), max(n_seq, 64))
    b.decode(llm, tokens, positions, seqs, all_rows)


def close_batch(llm: llama_cpp.Llama) -> None:
    b = llm.__dict__.pop("_ls_batch", None)
    if b is not None:
        b.close()


def decode_all_rows(llm: llama_cpp.Llama, tokens) -> None:
    """What ``llama_cpp.Llama.eval(tokens)`` does for one batch (len(tokens) <= n_batch), with the
    logits of every row kept in the context (``context.logits(llm, i)``) instead of the last only."""
    llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens, -1)
    n_past = llm.n_tokens
    decode(llm, tokens, range(n_past, n_past + len(tokens)))
    llm.input_ids[n_past:n_past + len(tokens)] = tokens
    llm.n_tokens += len(tokens)
    llm._requires_eval = False


def kv_cache_trim(llm: llama_cpp.Llama, n_past: int) -> None:
    """Drop every position >= n_past from llm's KV cache (what a draft decoded past it)."""
    llm._ctx.kv_cache_seq_rm(-1, n_past, -1)


# ---- speculative decoding's own generate loop (speculative.py) -------------------------------------

@contextlib.contextmanager
def context_params(**fields):
    """While ``llama_cpp.Llama.__init__`` runs: its context gets these llama_context_params fields
    (n_seq_max, kv_unified: a token tree's sequences in one KV cache). It builds the context from
    ``llama_context_default_params()`` and sets only other fields; that function is swapped for
    one returning the defaults with these set, for the duration of the call."""
    mod = llama_cpp.llama_cpp
    real = mod.llama_context_default_params

    def with_fields():
        p = real()
        for k, v in fields.items():
            setattr(p, k, v)
        return p

    mod.llama_context_default_params = with_fields
    try:
        yield
    finally:
        mod.llama_context_default_params = real


def reuse_prefix(llm: llama_cpp.Llama, tokens: list[int], reset: bool) -> tuple[list[int], bool]:
    """What ``llama_cpp.Llama.generate`` does before it evaluates: with reset, keep the KV cache's
    longest prefix of the new prompt (a whole cached prompt whose logits are live is evaluated no
    further; otherwise at least its last token is). Returns (the tokens to evaluate, whether to
    reset)."""
    if not (reset and llm.n_tokens > 0):
        return tokens, reset
    longest = 0
    for a, b in zip(llm.input_ids[: llm.n_tokens], tokens):
        if a != b:
            break
        longest += 1
    consumed = longest == len(tokens)
    if llm.n_tokens == len(tokens) and consumed and not llm._requires_eval:
        return [], False
    keep = longest - 1 if consumed else longest
    if keep > 0 and llm._ctx.kv_cache_seq_rm(-1, keep, -1):
        llm.n_tokens = keep
        llm._requires_eval = True
        return tokens[keep:], False
    return tokens, reset


def sampler(llm: llama_cpp.Llama, **kw):
    """The sampler chain ``generate`` builds from its sampling arguments (temp, top_k, top_p,
    min_p, penalties, mirostat, logits processors, grammar), as a function: ``sample(row)``
    samples a row of the last decode (-1: its last) and accepts the token."""
    llm._mirostat_mu = ctypes.c_float(2.0 * kw.get("mirostat_tau", 5.0))
    s = llm._init_sampler(**kw)
    llm._sampler = s
    return lambda row: s.sample(llm._ctx, row)


def input_ids(llm: llama_cpp.Llama):
    """The tokens in the KV cache (a view)."""
    return llm.input_ids[: llm.n_tokens]


def last_scores(llm: llama_cpp.Llama):
    """What llama-cpp-python's generate hands stopping criteria as the scores (with logits_all
    the last evaluated row's logits; otherwise a row it does not fill)."""
    return llm.scores[max(0, llm.n_tokens - 1) if llm._logits_all else 0, :]


def logits_stale(llm: llama_cpp.Llama) -> None:
    """The last decode's logits are not those of the last token in the KV cache."""
    llm._requires_eval = True


def set_context(llm: llama_cpp.Llama, n_past: int, tokens: list[int]) -> None:
    """input_ids/n_tokens say the context is input_ids[:n_past] + tokens (what a logits processor
    reads while a tree row is sampled)."""
    llm.input_ids[n_past:n_past + len(tokens)] = tokens
    llm.n_tokens = n_past + len(tokens)


def tree_decode(llm: llama_cpp.Llama, tokens, positions, seqs, n_seq: int) -> None:
    """Decodes a token tree's batch after the KV cache's n_tokens (tree.py): the context is copied
    into sequences 1 .. n_seq - 1 first; every row's logits are kept (``logits(row)``). A decode
    that fails (the op's read error, raised after the graph ran) leaves the KV cache as it was:
    the context alone, in sequence 0."""
    mem = llama_cpp.llama_get_memory(llm.ctx)
    for s in range(1, n_seq):
        llama_cpp.llama_memory_seq_cp(mem, 0, s, -1, -1)
    try:
        decode(llm, tokens, positions, seqs)
    except BaseException:
        tree_keep(llm, llm.n_tokens, [], n_seq)
        llm._requires_eval = True
        raise


def tree_keep(llm: llama_cpp.Llama, n_past: int, kept: list[int], n_seq: int) -> None:
    """After a tree pass: the KV cache holds the context, then ``kept`` (the pending tokens and the
    accepted nodes of the main path, sequence 0, in order) and nothing else."""
    mem = llama_cpp.llama_get_memory(llm.ctx)
    for s in range(1, n_seq):
        llama_cpp.llama_memory_seq_rm(mem, s, -1, -1)
    n = n_past + len(kept)
    llama_cpp.llama_memory_seq_rm(mem, 0, n, -1)
    llm.input_ids[n_past:n] = kept
    llm.n_tokens = n


# ---- closing -------------------------------------------------------------------------------------

CLOSED = "this Llama is closed (close() was called); create a new one to continue"


class _Closed:
    """Stands in for a native handle of a closed Llama: any use raises ``error(CLOSED)``."""

    def __init__(self, error: type[Exception]):
        object.__setattr__(self, "_error", error)

    def __getattr__(self, attr):
        raise self._error(CLOSED)

    def __call__(self, *a, **k):
        raise self._error(CLOSED)

    def __bool__(self):
        return True


def close(llm: llama_cpp.Llama, error: type[Exception]) -> None:
    """``llama_cpp.Llama.close(llm)``, once, then every handle-holding attribute replaced by a
    stand-in raising ``error``: llama-cpp-python leaves the freed handles behind, and any later
    call would use freed memory. A Llama whose __init__ failed before its first handle has
    nothing to close."""
    if not hasattr(llm, "_stack") or llm.__dict__.get("_closed"):
        return
    llm._closed = True
    llama_cpp.Llama.close(llm)
    for name in HANDLE_ATTRS:
        if name in llm.__dict__:
            setattr(llm, name, _Closed(error))


# ---- the server ----------------------------------------------------------------------------------

def server_modules():
    """llama-cpp-python's server modules (app, model); RuntimeError naming the extra to install."""
    try:
        from llama_cpp.server import app as server_app
        from llama_cpp.server import model as server_model
    except ImportError as e:
        raise RuntimeError(f"the server needs llama-cpp-python's server dependencies ({e}); install them with "
                           f"`pip install 'leanstream-ggml[server]'`") from None
    return server_app, server_model


class _LlamaCppWith:
    """The ``llama_cpp`` module as their model loader sees it while it loads: every attribute is
    the real module's except ``Llama``."""

    def __init__(self, real, llama_factory):
        self._real = real
        self.Llama = llama_factory

    def __getattr__(self, name):
        return getattr(self._real, name)


def create_server_app(llama_factory, *, server_settings, model_settings):
    """(app, current): llama-cpp-python's FastAPI app (``create_app``) whose model is loaded by
    their own loader (``LlamaProxy.load_llama_from_model_settings``: chat formats, caches, kv
    overrides, ... keep working) calling ``llama_factory(model_path=..., n_ctx=..., ...)`` in
    place of ``llama_cpp.Llama``; ``current()`` is the loaded model (None before loading or after
    it was freed)."""
    server_app_mod, server_model = server_modules()

    class Proxy(server_model.LlamaProxy):
        def load_llama_from_model_settings(self, settings):
            # their loader calls `llama_cpp.Llama(...)` through its module's global `llama_cpp`;
            # pointing that name at a view whose Llama is ours, for the duration of the call,
            # keeps every argument of theirs without copying the loader
            real = server_model.llama_cpp
            server_model.llama_cpp = _LlamaCppWith(real, llama_factory)
            try:
                return server_model.LlamaProxy.load_llama_from_model_settings(settings)
            finally:
                server_model.llama_cpp = real

    holder = {}

    def make_proxy(models):
        holder["proxy"] = Proxy(models)
        return holder["proxy"]

    # create_app builds its model holder from its module's name `LlamaProxy` (and loads the model
    # there); ours is put under that name while it runs
    real = server_app_mod.LlamaProxy
    server_app_mod.LlamaProxy = make_proxy
    try:
        app = server_app_mod.create_app(server_settings=server_settings, model_settings=[model_settings])
    finally:
        server_app_mod.LlamaProxy = real

    def current():
        proxy = holder.get("proxy")
        return None if proxy is None else proxy._current_model

    return app, current
