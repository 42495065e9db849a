"""`leanstream serve`: llama-cpp-python's OpenAI-compatible server with the plugin's Llama inside.

    leanstream serve MODEL_DIR [--memory-budget 1GB] [--mode dense] [--host 127.0.0.1] [--port 8000]
                     [every option of `python -m llama_cpp.server`: --n_ctx 4096 --api_key KEY ...]

The application is llama-cpp-python's own (``llama_cpp.server.app.create_app``, its ``[server]``
extra): every endpoint (/v1/chat/completions, /v1/completions, /v1/models, /v1/embeddings,
/extras/tokenize, ...), request field, error body and SSE stream is theirs, and so is every
option (their names, with underscores). The one difference is the model class: the model is
loaded by their own loader (so chat formats, caches, kv overrides, ... keep working) with
``leanstream_ggml.Llama`` in place of ``llama_cpp.Llama`` (``_llama_cpp.create_server_app``).
One endpoint is added:

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

from leanstream_ggml import options

# the engine options the server takes (options.py: Llama's, and reuse_prefix, the server's own);
# only those the user gave are passed, the rest keep their defaults
LEANSTREAM_OPTIONS = tuple(o.name for o in options.for_command("serve"))


def _served_llama_class():
    from leanstream_ggml.native._native import LeanstreamError
    from leanstream_ggml.llama import Llama

    class ServedLlama(Llama):
        """``Llama`` as the server runs it. Every request starts from an empty context (unless
        reuse_prefix): llama-cpp-python would otherwise evaluate only what follows the prefix it
        shares with the previous request, and a prompt evaluated in other batches can round
        differently, so an answer would depend on the request before it. After an engine error
        (a block that cannot be read, or is corrupt) the context is reset; the error reaches the
        client as a 500 before the first token or as an error event in the stream
        (_RejectInvalidBodies). Every completion of theirs, chat or not, streamed or not, comes
        through create_completion (their streaming routes call the base class's methods)."""

        def __init__(self, *args, reuse_prefix: bool | None = None, **kwargs):
            self.reuse_prefix = options.BY_NAME["reuse_prefix"].default if reuse_prefix is None else reuse_prefix
            super().__init__(*args, **kwargs)

        def create_completion(self, *args, **kwargs):
            if not self.reuse_prefix:
                self.reset()
            try:
                out = super().create_completion(*args, **kwargs)
            except LeanstreamError:
                self.reset()
                raise
            return self._reset_on_error(out) if kwargs.get("stream") else out

        def _reset_on_error(self, chunks):
            try:
                yield from chunks
            except LeanstreamError:
                self.reset()
                raise

    return ServedLlama


def _error_status(e: BaseException) -> tuple[int, str]:
    """(HTTP status, message) for an error inside e (sse_starlette wraps it in exception groups):
    an engine error is a 500 naming the file and block; a prompt longer than the context a 400."""
    from leanstream_ggml.native._native import LeanstreamError

    stack, seen = [e], set()
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, LeanstreamError):
            return 500, f"the model's FFN weights could not be read: {x}"
        if isinstance(x, ValueError) and "exceed context window" in str(x):
            return 400, f"the prompt does not fit the context window: {x}"
        stack += list(getattr(x, "exceptions", ())) + [x.__cause__, x.__context__]
    return 500, f"the answer broke off: {type(e).__name__}: {e}"


class _RejectInvalidBodies:
    """ASGI middleware: a POST to an OpenAI endpoint whose body is not valid JSON (400) or does not
    validate against llama-cpp-python's own request model (422) is answered here, with an
    OpenAI-style error. Their route error handler turns FastAPI's validation error into a 500
    (and a traceback on stderr); every valid request passes through untouched (its body is
    replayed, later messages such as a client's disconnect come from the connection). The model
    serves one request at a time: beyond max_waiting requests in flight (running + queued), a new
    one is answered 429 at once rather than held."""

    def __init__(self, app, models: dict, max_waiting: int = 0, n_ctx: int = 0):
        self.app = app
        self.models = models   # path -> pydantic request model
        self.n_ctx = n_ctx     # a max_tokens above the context window is refused (theirs: cut to fit)
        self.max_waiting = max_waiting   # 0: no limit
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        model = self.models.get(scope.get("path")) if scope["type"] == "http" and scope.get("method") == "POST" else None
        if model is None:
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        if body is None:     # the client went away
            return
        error = self._refusal(model, body)
        if error is not None:
            from starlette.responses import JSONResponse

            status, message = error
            kind = "rate_limit_error" if status == 429 else "invalid_request_error"
            resp = JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                                status_code=status)
            return await resp(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        stream = _HeldStream(send)
        self.in_flight += 1
        try:
            await self.app(scope, replay, stream.send)
        except Exception as e:   # noqa: BLE001 — anything that breaks off a stream the client is reading
            if not stream.sse:
                raise
            await stream.fail(e, scope, receive)
        finally:
            self.in_flight -= 1
            await stream.finish()

    def _refusal(self, model, body: bytes):
        """(status, message) of a request answered here (not JSON, invalid, too many waiting), or None."""
        error = self._check(model, body, self.n_ctx)
        if error is None and self.max_waiting and self.in_flight >= self.max_waiting:
            error = 429, (f"{self.in_flight} requests are already running or waiting for this model "
                          f"(--max-waiting-requests {self.max_waiting}); retry later")
        return error

    @staticmethod
    def _check(model, body: bytes, n_ctx: int = 0):
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
        max_tokens = obj.get("max_tokens") if isinstance(obj, dict) else None
        if n_ctx and isinstance(max_tokens, int) and max_tokens > n_ctx:
            return 400, (f"max_tokens {max_tokens} exceeds the context window ({n_ctx} tokens, prompt included); "
                         f"ask for at most {n_ctx}")
        return None


async def _read_body(receive) -> bytes | None:
    """A request's whole body (None: the client disconnected first)."""
    chunks, more = [], True
    while more:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunks.append(msg.get("body", b""))
        more = msg.get("more_body", False)
    return b"".join(chunks)


class _HeldStream:
    """The ASGI ``send`` of a request, with an event stream's start held until its first bytes, and
    its last message (the end of the body) until the app returns: their streaming routes start
    the answer only after the 200 is sent, so a request that fails before its first token (a
    prompt longer than the context, a block that cannot be read) is answered 400 / 500 instead
    (``fail``), and one that breaks off mid-answer ends with an error event, which the OpenAI
    client raises as APIError, rather than looking complete. (Keep-alive pings sent while the
    request waits for the model are held with the start.)"""

    def __init__(self, send):
        self._send = send
        self.sse, self.start, self.started, self.end, self.pings = False, None, False, None, []

    async def send(self, msg) -> None:
        if msg["type"] == "http.response.start":
            self.sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                           for k, v in msg.get("headers", ()))
            if self.sse:
                self.start = msg
                return
        elif self.sse and msg["type"] == "http.response.body":
            if not msg.get("more_body", False):
                self.end = msg
                return
            if not self.started:
                if b"data:" not in msg.get("body", b""):
                    self.pings.append(msg)
                    return
                await self._send_start()
                self.started = True
        await self._send(msg)

    async def _send_start(self) -> None:
        await self._send(self.start)
        for p in self.pings:
            await self._send(p)

    async def fail(self, e: BaseException, scope, receive) -> None:
        """The event stream broke off with e: a plain error response where nothing was sent yet,
        else an error event after what was (the end is sent by ``finish``)."""
        import json

        status, message = _error_status(e)
        event = {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                           "param": None, "code": status}}
        if not self.started:   # nothing sent yet: a plain error response
            from starlette.responses import JSONResponse

            self.end = None
            await JSONResponse(event, status_code=status)(scope, receive, self._send)
            return
        if self.end is not None and self.end.get("body"):
            await self._send({"type": "http.response.body", "body": self.end["body"], "more_body": True})
        await self._send({"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(),
                          "more_body": True})
        self.end = {"type": "http.response.body", "body": b"", "more_body": False}

    async def finish(self) -> None:
        """What was held: the start (where no data came) and the end."""
        if self.end is not None:
            if self.sse and not self.started and self.start is not None:
                await self._send_start()
            await self._send(self.end)


def create_app(model_dir: str | Path, *, server_settings=None, model_settings=None, max_waiting_requests: int = 8,
               **leanstream_options):
    """llama-cpp-python's FastAPI app serving ``leanstream_ggml.Llama(model_dir, **leanstream_options)``.

    server_settings / model_settings: their ``ServerSettings`` / ``ModelSettings`` (default:
    their defaults; ``model_settings.model`` is set to model_dir). leanstream_options: any of
    LEANSTREAM_OPTIONS (options.py: Llama's engine options, and reuse_prefix, default False: every
    request starts from an empty context).
    max_waiting_requests: requests in flight (running + queued) beyond which a new one gets 429.
    """
    from leanstream_ggml.llamacpp._llama_cpp import create_server_app, server_modules

    server_modules()
    from fastapi import Depends

    from llama_cpp.server.settings import ModelSettings, ServerSettings

    unknown = set(leanstream_options) - set(LEANSTREAM_OPTIONS)
    if unknown:
        raise TypeError(f"unknown leanstream options: {', '.join(sorted(unknown))}")
    server_settings = server_settings or ServerSettings()
    if model_settings is None:
        model_settings = ModelSettings(model=str(model_dir))
    update = {"model": str(model_dir)}
    if "flash_attn" not in model_settings.model_fields_set:
        # theirs defaults to False and is passed to Llama explicitly; the plugin's default (True)
        # is the attention whose batch rows round as the token alone, so that speculation and
        # batching change no answer (docs/design.md §21)
        update["flash_attn"] = True
    model_settings = model_settings.model_copy(update=update)
    app, current = create_server_app(functools.partial(_served_llama_class(), **leanstream_options),
                                     server_settings=server_settings, model_settings=model_settings)

    def leanstream_stats():
        # read without the server's model locks: the counters are atomics, and taking the locks
        # would wait for (or, with interrupt_requests, cut short) a generation in progress
        llm = current()
        if llm is None:
            return {"model": str(model_dir), "loaded": False}
        if llm.backend == "stock":
            return {"model": str(model_dir), "loaded": True, "backend": "stock", "source": str(llm.source_path)}
        return {"model": str(model_dir), "loaded": True, "mode": llm.mode, "sparsity": llm.sparsity,
                "memory_budget": llm.engine.memory_budget, "params": llm.engine.params, "stats": llm.stats(),
                "memory_plan": (None if llm.memory_plan is None else
                                {**llm.memory_plan.parts, "limit": llm.memory_plan.limit,
                                 "budget": llm.memory_plan.budget, "resident": llm.memory_plan.resident})}

    from llama_cpp.server.app import authenticate
    from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest, CreateEmbeddingRequest

    app.add_middleware(_RejectInvalidBodies, max_waiting=max_waiting_requests, n_ctx=model_settings.n_ctx, models={
        "/v1/chat/completions": CreateChatCompletionRequest, "/v1/completions": CreateCompletionRequest,
        "/v1/engines/copilot-codex/completions": CreateCompletionRequest, "/v1/embeddings": CreateEmbeddingRequest})
    app.add_api_route("/leanstream/stats", leanstream_stats, methods=["GET"], summary="LeanStream engine counters",
                      dependencies=[Depends(authenticate)], tags=["LeanStream"])
    return app


def build_parser() -> argparse.ArgumentParser:
    from llama_cpp.server.cli import add_args_from_model
    from llama_cpp.server.settings import Settings

    p = argparse.ArgumentParser(prog="leanstream serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", default=None,
                   help="model directory from `leanstream convert`, or a converted known model name")
    g = p.add_argument_group("leanstream")
    options.add_flags(g, "serve")
    g.add_argument("--max-waiting-requests", type=int, default=8,
                   help="requests running or queued beyond which a new one is answered 429 (0: no limit)")
    s = p.add_argument_group("llama-cpp-python server options (as `python -m llama_cpp.server`; --model = MODEL_DIR)")
    add_args_from_model(s, Settings)
    # loopback unless told otherwise (theirs: "localhost"); logits of the last token only (theirs keep
    # n_ctx x n_vocab floats for logprobs: 200 MB for SmolLM2 at n_ctx 1024, 620 MB for Qwen2.5)
    p.set_defaults(host="127.0.0.1", logits_all=False)
    # flash attention unless told otherwise, as Llama (create_app)
    for a in s._group_actions:
        if a.dest == "flash_attn":
            a.help = "Whether to use flash attention (default: True, the plugin's Llama default)"
    return p


def leanstream_options(ns: argparse.Namespace) -> dict:
    """The engine options the user gave on the command line (the others stay the engine's)."""
    return options.given(ns, "serve")


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from leanstream_ggml.llamacpp._llama_cpp import server_modules

        server_modules()
        import uvicorn
    except (RuntimeError, ImportError) as e:
        print(f"leanstream serve: {e}", file=sys.stderr)
        return 1
    from llama_cpp.server.cli import parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from leanstream_ggml.native._native import LeanstreamError
    from leanstream_ggml.model.manifest import ManifestError
    from leanstream_ggml.model.registry import converted_model_dir

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
        if ns.max_waiting_requests < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0, got {ns.max_waiting_requests}")
        app = create_app(model_dir, server_settings=server_settings, model_settings=model_settings,
                         max_waiting_requests=ns.max_waiting_requests, **options)
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
