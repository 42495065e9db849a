"""`leanstream serve`: llama-cpp-python's OpenAI-compatible server with the plugin's Llama inside.

    leanstream serve MODEL_DIR [--memory-budget 1GB] [--mode dense] [--host 127.0.0.1] [--port 8000]
                     [every option of `python -m llama_cpp.server`: --n_ctx 4096 --api_key KEY ...]

The application is llama-cpp-python's own (``llama_cpp.server.app.create_app``, its ``[server]``
extra): every endpoint (/v1/chat/completions, /v1/completions, /v1/models, /v1/embeddings,
/extras/tokenize, ...), request field, error body and SSE stream is theirs, and so is every
option (their names, with underscores). The one difference is the model class: the model is
loaded by their own loader (``LlamaProxy.load_llama_from_model_settings``, so chat formats,
caches, kv overrides, ... keep working) with ``leanstream_ggml.Llama`` in place of
``llama_cpp.Llama``. One endpoint is added:

    GET /leanstream/stats   the engine's counters (``llm.stats()``) and memory settings

and one thing corrected: a request body that is not JSON, or does not validate against their
request model, is answered 400 / 422 with an OpenAI-style error message (their route error
handler answers such requests with a 500).

Requests are served one at a time, as in llama-cpp-python's server (one model, one context).
With their default ``--interrupt_requests true`` a new request ends a stream in progress early;
``--interrupt_requests false`` lets each stream finish first.

MODEL_DIR is a directory written by ``leanstream convert`` or a known model name whose
conversion is in the model cache. Needs the server extra: ``pip install 'leanstream-ggml[server]'``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

# Llama's engine options the server takes; only those the user gave are passed (the rest keep the
# engine's own defaults)
LEANSTREAM_OPTIONS = ("memory_budget", "mode", "sparsity", "quality", "n_io_threads", "hot_fraction", "candidate_ratio",
                      "bridge_bytes")


def _server_modules():
    try:
        from llama_cpp.server import app as server_app
        from llama_cpp.server import model as server_model
    except ImportError as e:
        raise RuntimeError(f"the server needs llama-cpp-python's server dependencies ({e}); install them with "
                           f"`pip install 'leanstream-ggml[server]'`") from None
    return server_app, server_model


class _LlamaCppWithPlugin:
    """The ``llama_cpp`` module as llama-cpp-python's model loader sees it while it loads our
    model: every attribute is the real module's except ``Llama``."""

    def __init__(self, real, llama_factory):
        self._real = real
        self.Llama = llama_factory

    def __getattr__(self, name):
        return getattr(self._real, name)


def _proxy_class():
    server_app, server_model = _server_modules()

    class LeanstreamProxy(server_model.LlamaProxy):
        """llama-cpp-python's model holder, loading ``leanstream_ggml.Llama`` with its own loader."""

        def __init__(self, models, *, leanstream_options: dict):
            self.leanstream_options = dict(leanstream_options)
            super().__init__(models)

        def load_llama_from_model_settings(self, settings):
            from .llama import Llama

            # their loader calls `llama_cpp.Llama(model_path=..., n_ctx=..., ...)` through its
            # module's global `llama_cpp`; pointing that name at a view whose Llama is ours, for
            # the duration of the call, keeps every argument of theirs without copying the loader
            real = server_model.llama_cpp
            server_model.llama_cpp = _LlamaCppWithPlugin(real, functools.partial(Llama, **self.leanstream_options))
            try:
                return server_model.LlamaProxy.load_llama_from_model_settings(settings)
            finally:
                server_model.llama_cpp = real

        def current(self):
            """The loaded model (None before loading or after free)."""
            return self._current_model

    return LeanstreamProxy


class _RejectInvalidBodies:
    """ASGI middleware: a POST to an OpenAI endpoint whose body is not valid JSON (400) or does not
    validate against llama-cpp-python's own request model (422) is answered here, with an
    OpenAI-style error. Their route error handler turns FastAPI's validation error into a 500
    (and a traceback on stderr); every valid request passes through untouched (its body is
    replayed, later messages such as a client's disconnect come from the connection)."""

    def __init__(self, app, models: dict):
        self.app = app
        self.models = models   # path -> pydantic request model

    async def __call__(self, scope, receive, send):
        model = self.models.get(scope.get("path")) if scope["type"] == "http" and scope.get("method") == "POST" else None
        if model is None:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        error = self._check(model, body)
        if error is not None:
            from starlette.responses import JSONResponse

            status, message = error
            resp = JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                           "code": None}}, status_code=status)
            return await resp(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    def _check(model, body: bytes):
        import json

        from pydantic import ValidationError

        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return 400, f"the request body is not valid JSON: {e}"
        try:
            model.model_validate(obj)
        except ValidationError as e:
            errs = e.errors()
            shown = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}" for err in errs[:5])
            more = f" (and {len(errs) - 5} more)" if len(errs) > 5 else ""
            return 422, f"invalid request: {shown}{more}"
        return None


def create_app(model_dir: str | Path, *, server_settings=None, model_settings=None, **leanstream_options):
    """llama-cpp-python's FastAPI app serving ``leanstream_ggml.Llama(model_dir, **leanstream_options)``.

    server_settings / model_settings: their ``ServerSettings`` / ``ModelSettings`` (default:
    their defaults; ``model_settings.model`` is set to model_dir). leanstream_options: any of
    LEANSTREAM_OPTIONS (memory_budget, mode, sparsity, quality, n_io_threads, hot_fraction, candidate_ratio,
    bridge_bytes).
    """
    server_app, server_model = _server_modules()
    from fastapi import Depends

    from llama_cpp.server.settings import ModelSettings, ServerSettings

    unknown = set(leanstream_options) - set(LEANSTREAM_OPTIONS)
    if unknown:
        raise TypeError(f"unknown leanstream options: {', '.join(sorted(unknown))}")
    server_settings = server_settings or ServerSettings()
    if model_settings is None:
        model_settings = ModelSettings(model=str(model_dir))
    else:
        model_settings = model_settings.model_copy(update={"model": str(model_dir)})
    proxy_cls = functools.partial(_proxy_class(), leanstream_options=leanstream_options)
    holder = {}

    def make_proxy(models):
        holder["proxy"] = proxy_cls(models)
        return holder["proxy"]

    # create_app builds its model holder from its module's name `LlamaProxy` (and loads the model
    # there); ours is put under that name while it runs
    real = server_app.LlamaProxy
    server_app.LlamaProxy = make_proxy
    try:
        app = server_app.create_app(server_settings=server_settings, model_settings=[model_settings])
    finally:
        server_app.LlamaProxy = real

    def leanstream_stats():
        # read without the server's model locks: the counters are atomics, and taking the locks
        # would wait for (or, with interrupt_requests, cut short) a generation in progress
        llm = holder["proxy"].current()
        if llm is None:
            return {"model": str(model_dir), "loaded": False}
        return {"model": str(model_dir), "loaded": True, "mode": llm.mode, "sparsity": llm.sparsity,
                "memory_budget": llm.engine.memory_budget, "params": llm.engine.params, "stats": llm.stats()}

    from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest, CreateEmbeddingRequest

    app.add_middleware(_RejectInvalidBodies, models={
        "/v1/chat/completions": CreateChatCompletionRequest, "/v1/completions": CreateCompletionRequest,
        "/v1/engines/copilot-codex/completions": CreateCompletionRequest, "/v1/embeddings": CreateEmbeddingRequest})
    app.add_api_route("/leanstream/stats", leanstream_stats, methods=["GET"], summary="LeanStream engine counters",
                      dependencies=[Depends(server_app.authenticate)], tags=["LeanStream"])
    return app


def build_parser() -> argparse.ArgumentParser:
    from llama_cpp.server.cli import add_args_from_model
    from llama_cpp.server.settings import Settings

    p = argparse.ArgumentParser(prog="leanstream serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", default=None,
                   help="model directory from `leanstream convert`, or a converted known model name")
    g = p.add_argument_group("leanstream")
    g.add_argument("--memory-budget", default=None, help="FFN weights kept in RAM, e.g. 512MiB (default: all)")
    from ._native import MODES

    g.add_argument("--mode", default=None, choices=MODES,
                   help="dense (default): every neuron (exact); the others compute only the selected blocks")
    g.add_argument("--sparsity", type=float, default=None, help="fraction of blocks skipped per token in sparse modes")
    g.add_argument("--quality", default=None,
                   help="e.g. ppl+5%%: leanstream mode at the largest sparsity the converter measured within it")
    g.add_argument("--n-io-threads", type=int, default=None, help="I/O workers (reads in flight; default 16)")
    g.add_argument("--hot-fraction", type=float, default=None,
                   help="share of the budget pinned for hot blocks (default: the mode's)")
    g.add_argument("--candidate-ratio", type=float, default=None,
                   help="leanstream with a sketch: candidates per kept block (default 1.5)")
    g.add_argument("--bridge-bytes", type=int, default=None,
                   help="largest gap of unselected blocks a read goes through (default: measured)")
    s = p.add_argument_group("llama-cpp-python server options (as `python -m llama_cpp.server`; --model = MODEL_DIR)")
    add_args_from_model(s, Settings)
    return p


def leanstream_options(ns: argparse.Namespace) -> dict:
    """The engine options the user gave on the command line (the others stay the engine's)."""
    return {k: getattr(ns, k) for k in LEANSTREAM_OPTIONS if getattr(ns, k) is not None}


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        server_app, _ = _server_modules()
        import uvicorn
    except (RuntimeError, ImportError) as e:
        print(f"leanstream serve: {e}", file=sys.stderr)
        return 1
    from llama_cpp.server.cli import parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from ._native import LeanstreamError
    from .manifest import ManifestError
    from .models import converted_model_dir

    ns = build_parser().parse_args(args.argv)
    model = ns.model_dir or ns.model
    if not model:
        print("leanstream serve: give a model directory (leanstream serve MODEL_DIR)", file=sys.stderr)
        return 2
    try:
        model_dir = converted_model_dir(model, "serve")
        ns.model = str(model_dir)
        server_settings = parse_model_from_args(ServerSettings, ns)
        model_settings = parse_model_from_args(ModelSettings, ns)
        options = leanstream_options(ns)
        app = create_app(model_dir, server_settings=server_settings, model_settings=model_settings, **options)
    except (ValueError, ManifestError, LeanstreamError) as e:
        print(f"leanstream serve: {e}", file=sys.stderr)
        return 1
    uvicorn.run(app, host=server_settings.host, port=server_settings.port,
                ssl_keyfile=server_settings.ssl_keyfile, ssl_certfile=server_settings.ssl_certfile)
    return 0


def register(sub) -> None:
    # the options are llama-cpp-python's, known only once its server module is imported: this
    # parser hands every argument through (no prefix characters) and cmd_serve parses them
    p = sub.add_parser("serve", help="OpenAI-compatible server (llama-cpp-python's) with a converted model",
                       description="leanstream serve MODEL_DIR [options]; see `leanstream serve --help`",
                       add_help=False, prefix_chars="\0")
    p.add_argument("argv", nargs="*")
    p.set_defaults(func=cmd_serve)
