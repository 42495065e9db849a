"""`leanstream serve` under load and under disk faults, over real HTTP on 127.0.0.1 with the official
OpenAI client (bench/serve_load.py runs the server and the clients; its long form is a benchmark).

Load (short form): SmolLM2, 4 concurrent clients for 2 minutes, the server in a 600 MB memory
cgroup (SmolLM2's server peaks near 220 MB there). Faults: a read that fails (EIO), arrives short or
arrives corrupt (test hooks: the server runs through tests/support/engine_hooks.py, which gives its
engines the hooks of a file this test writes), and a block file truncated under the running
server, each during a streamed answer: that answer ends with an error event, the server keeps
serving, and the same request then gets the right answer.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

openai = pytest.importorskip("openai", reason="the server tests use the official OpenAI client (test extra)")
pytest.importorskip("fastapi", reason="leanstream serve needs the server extra")

from leanstream_tools import cgroup  # noqa: E402
import bench_modules  # noqa: E402
import engine_hooks  # noqa: E402

serve_load = bench_modules.load("serve_load")

CG_OK, CG_WHY = cgroup.availability()
LONG = {"kind": "chat", "messages": [{"role": "user", "content": "Count from one to sixty in words."}], "max_tokens": 64}


@pytest.mark.skipif(not CG_OK, reason=f"no memory cgroup here: {CG_WHY}")
def test_four_clients_for_two_minutes_under_600mb(smollm2_dir, tmp_path):
    r = serve_load.run(str(smollm2_dir), clients=4, minutes=2.0, memory_limit="600MB", memory_budget="64MiB",
                       n_ctx=1024, seed=1, log_dir=str(tmp_path))
    print("\n" + json.dumps(r, indent=1))
    assert r["memory_limit_bytes"] == 600_000_000
    assert r["server_alive_at_end"] and r["oom_kills"] == 0
    assert r["peak_memory_bytes"] <= r["memory_limit_bytes"]
    assert r["completed"] >= 20
    assert r["identical_to_alone"] == 1.0, r["mismatches"]          # greedy: every answer as alone
    assert r["outcomes"].get("5xx", 0) == 0 and r["outcomes"].get("stream error", 0) == 0
    assert r["outcomes"].get("connection error", 0) == 0
    assert r["outcomes"].get("bad request answered 2xx", 0) == 0     # too long, absurd max_tokens: 4xx
    assert r["outcomes"].get("4xx", 0) > 0 and set(r["errors"]) >= {"400"}
    assert r["outcomes"].get("disconnected by its client", 0) > 0
    assert r["latency_p95_s"] >= r["latency_p50_s"] > 0


class _Server:
    def __init__(self, model_dir, tmp_path, hooks: dict | None = None, budget="16MiB", args=None, api_key="unused"):
        self.port = serve_load._free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"server-{self.port}.log"
        launcher = engine_hooks.launcher(hooks, tmp_path) if hooks else None
        self.proc, self.cg, _ = serve_load.start_server(str(model_dir), self.port, budget, 512, None, self.log,
                                                        launcher, args)
        serve_load.wait_up(self.base, self.proc, self.log, headers={"Authorization": f"Bearer {api_key}"})
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, timeout=300, max_retries=0)

    def ask(self, req=LONG, stream=True):
        return serve_load.ask(self.client, req, stream=stream)

    def close(self):
        serve_load.stop_server(self.proc, self.cg)


@pytest.fixture(scope="module")
def reference(smollm2_dir, tmp_path_factory):
    """The long answer from a fault-free server (every request starts from an empty context)."""
    s = _Server(smollm2_dir, tmp_path_factory.mktemp("ref"))
    try:
        text, finish, n = s.ask()
        assert s.ask(stream=False)[0] == text   # streamed and not: the same greedy answer
    finally:
        s.close()
    assert n > 10 and finish in ("stop", "length")
    return text


@pytest.mark.parametrize("fault,message", [("eio", "I/O error"), ("short", "short read"), ("corrupt", "is corrupt")])
def test_a_read_fault_mid_stream_ends_that_answer_only(smollm2_dir, tmp_path, reference, fault, message):
    # 16 MiB of SmolLM2's 71 MB FFN: dense decode streams ~230 reads per token, so read 1500 fails
    # a few tokens into the first answer
    s = _Server(smollm2_dir, tmp_path, hooks={"fault": fault, "fault_read": 1500})
    try:
        with pytest.raises(openai.APIError, match=message) as ei:
            s.ask()
        assert "could not be read" in str(ei.value)
        assert s.proc.poll() is None
        for _ in range(2):   # the block is read again: the same request is answered right
            assert s.ask()[0] == reference
        stats = json.loads(serve_load.urllib.request.urlopen(s.base + "/leanstream/stats", timeout=30).read())
        assert stats["stats"]["cache_bytes"] <= stats["stats"]["cache_capacity"]
    finally:
        s.close()


def test_a_read_fault_before_the_first_token_is_a_500(smollm2_dir, tmp_path, reference):
    s = _Server(smollm2_dir, tmp_path, hooks={"fault": "eio", "fault_read": 5})   # during the prompt's prefill
    try:
        with pytest.raises(openai.InternalServerError, match="could not be read.*I/O error"):
            s.ask()
        too_long = {"kind": "completion", "prompt": "word " * 2000, "max_tokens": 4}
        with pytest.raises(openai.BadRequestError, match="context window"):   # streamed: 400 before any chunk
            s.ask(too_long)
        assert s.ask()[0] == reference
    finally:
        s.close()


def test_block_file_truncated_then_restored_under_a_running_server(smollm2_dir, tmp_path, reference):
    d = tmp_path / "model.lsm"
    shutil.copytree(smollm2_dir, d)
    victim = d / "ffn" / "blk.20.bin"
    data = victim.read_bytes()
    s = _Server(d, tmp_path)
    try:
        assert s.ask()[0] == reference
        os.truncate(victim, len(data) // 2)        # blocks past the cut: short reads
        with pytest.raises(openai.APIError, match="short read"):
            s.ask()
        assert s.proc.poll() is None
        victim.write_bytes(data)                   # repaired in place: served right again
        assert s.ask()[0] == reference
        # replaced by a new file (rename over it): the server keeps reading the file it opened
        tmp = victim.with_suffix(".new")
        tmp.write_bytes(b"\0" * len(data))
        os.replace(tmp, victim)
        assert s.ask()[0] == reference
    finally:
        s.close()


def test_loopback_by_default_api_key_and_a_limit_on_waiting_requests(smollm2_dir, tmp_path):
    """Binds 127.0.0.1 unless told otherwise; llama-cpp-python's --api_key guards the endpoints;
    beyond --max-waiting-requests in flight a request is answered 429 at once."""
    import threading

    s = _Server(smollm2_dir, tmp_path, args=["--api_key", "sesame", "--max-waiting-requests", "1"], api_key="sesame")
    try:
        assert "Uvicorn running on http://127.0.0.1:" in s.log.read_text()
        stranger = openai.OpenAI(base_url=s.base + "/v1", api_key="wrong", timeout=60, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
        first_chunk = threading.Event()
        done = {}

        def long_answer():
            stream = s.client.chat.completions.create(model="any", messages=LONG["messages"], max_tokens=64,
                                                      temperature=0.0, stream=True)
            for _ in stream:
                first_chunk.set()
            done["ok"] = True

        t = threading.Thread(target=long_answer)
        t.start()
        assert first_chunk.wait(120)
        with pytest.raises(openai.RateLimitError, match="already running or waiting"):
            s.ask(stream=False)
        t.join(120)
        assert done.get("ok")
        # served again once the first has finished: the client stops reading at `data: [DONE]`,
        # a moment before the server's route returns and frees its place
        deadline = time.monotonic() + 30
        while True:
            try:
                assert s.ask(stream=False)[0]
                break
            except openai.RateLimitError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        s.close()


def _asgi_run(app, body: bytes) -> list[dict]:
    """Messages an ASGI app sends for one POST /v1/completions with this body."""
    import asyncio

    sent, got_body = [], [False]

    async def receive():
        if not got_body[0]:
            got_body[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(app(scope, receive, send))
    return sent


@pytest.mark.parametrize("fail_after_data", [False, True])
def test_stream_failures_become_error_answers(fail_after_data):
    """The middleware's contract on an event stream that raises: before its first data (only a
    keep-alive ping sent, as while a request waits for the model) the client gets a plain 400;
    after data, the data and then an error event; never a stream that looks complete."""
    from llama_cpp.server.types import CreateCompletionRequest

    from leanstream_ggml.commands.server import _RejectInvalidBodies

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": b": ping - 2026-12-01\r\n\r\n", "more_body": True})
        if fail_after_data:
            await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
        raise ExceptionGroup("task group", [ValueError("Requested tokens (2000) exceed context window of 1024")])

    mw = _RejectInvalidBodies(app, models={"/v1/completions": CreateCompletionRequest}, n_ctx=1024)
    sent = _asgi_run(mw, json.dumps({"prompt": "x", "stream": True}).encode())
    starts = [m for m in sent if m["type"] == "http.response.start"]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert len(starts) == 1 and sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body", False)
    if fail_after_data:
        assert starts[0]["status"] == 200
        assert body.index(b'data: {"choices"') < body.index(b'data: {"error"') and b"context window" in body
    else:
        assert starts[0]["status"] == 400
        assert json.loads(body)["error"]["message"].startswith("the prompt does not fit the context window")
    assert mw.in_flight == 0
    too_many = _asgi_run(_RejectInvalidBodies(app, models={"/v1/completions": CreateCompletionRequest}, n_ctx=1024),
                         json.dumps({"prompt": "x", "max_tokens": 5000}).encode())
    assert too_many[0]["status"] == 400 and b"exceeds the context window" in too_many[1]["body"]
