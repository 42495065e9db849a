"""`leanstream serve` end to end: llama-cpp-python's server application with the plugin's Llama
inside, in its own process, spoken to over real HTTP on 127.0.0.1 with the official OpenAI client.

The server runs with --interrupt_requests false (llama-cpp-python's default, true, ends a stream
early when another request arrives; both behaviours are theirs) and 2 threads, so its output is
comparable token for token with an in-process Llama on the same directory. Every wait is
bounded; the server process is killed at the end of the module. (On SmolLM2: the full suite.)

On a tiny mixture-of-experts model (the fast tier): every endpoint the application has, through
the application itself in this process (what `leanstream serve` runs under uvicorn), and in the
full suite `leanstream serve` in its own process.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

import bench_modules

openai = pytest.importorskip("openai", reason="the server tests use the official OpenAI client (test extra)")
pytest.importorskip("fastapi", reason="leanstream serve needs the server extra")

serve_load = bench_modules.load("serve_load")   # starts, waits for and stops the server process

START_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc, cg, _ = serve_load.start_server(str(smollm2_dir), port, "64MiB", 1024, None, log)
    base = f"http://127.0.0.1:{port}"
    try:
        serve_load.wait_up(base, proc, log, timeout_s=START_TIMEOUT_S)
        yield {"base": base, "proc": proc, "log": log, "model_dir": smollm2_dir}
    finally:
        serve_load.stop_server(proc, cg)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S,
                         max_retries=0)


MESSAGES = [{"role": "user", "content": "Name three primary colors."}]


def _stream_chat(client, messages=MESSAGES, max_tokens=24, times=None):
    stream = client.chat.completions.create(model="any", messages=messages, max_tokens=max_tokens,
                                            temperature=0.0, stream=True)
    text, finish = [], None
    for chunk in stream:
        if times is not None:
            times.append(time.monotonic())
        choice = chunk.choices[0]
        if choice.delta.content:
            text.append(choice.delta.content)
        finish = choice.finish_reason or finish
    return "".join(text), finish


def test_models_lists_the_model_directory(client, server):
    ids = [m.id for m in client.models.list().data]
    assert ids == [str(server["model_dir"])]


def test_streamed_chat_completion(client):
    text, finish = _stream_chat(client)
    full = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=24, temperature=0.0)
    print(f"\nstreamed: {text!r}\nfull:     {full.choices[0].message.content!r}")
    assert text.strip()
    assert finish in ("stop", "length")
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 0


def test_plain_completion_is_the_plugins(client, server):
    """The same greedy text as leanstream_ggml.Llama in this process (same dir, same threads):
    the model behind the endpoints is the plugin, and its engine counted the work."""
    from leanstream_ggml import Llama

    before = _get_json(server["base"] + "/leanstream/stats")["stats"]["op_calls"]
    prompt = "The capital of France is"
    # the server's request defaults differ from Llama.__call__'s in one sampling field (theirs)
    got = client.completions.create(model="any", prompt=prompt, max_tokens=8, temperature=0.0,
                                    extra_body={"repeat_penalty": 1.0})
    after = _get_json(server["base"] + "/leanstream/stats")
    # (the server keeps the plugin's flash attention: its --flash_attn defaults to theirs, False)
    llm = Llama(str(server["model_dir"]), n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False)
    try:
        ref = llm(prompt, max_tokens=8, temperature=0.0)["choices"][0]["text"]
    finally:
        llm.close()
    print(f"\nserver: {got.choices[0].text!r}\nlocal:  {ref!r}")
    assert got.choices[0].text == ref
    assert got.object == "text_completion"
    assert after["mode"] == "dense" and after["memory_budget"] == 64 << 20
    assert after["stats"]["op_calls"] > before
    assert after["stats"]["cache_bytes"] <= after["stats"]["cache_capacity"] <= 64 << 20


def test_two_concurrent_clients_are_answered_in_turn(client):
    results, times = {}, {"a": [], "b": []}

    def ask(name, content):
        msgs = [{"role": "user", "content": content}]
        results[name] = _stream_chat(client, msgs, max_tokens=24, times=times[name])

    threads = [threading.Thread(target=ask, args=("a", "Name a fruit.")),
               threading.Thread(target=ask, args=("b", "Name a vegetable."))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * REQUEST_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a client got no complete answer"
    for name in ("a", "b"):
        text, finish = results[name]
        assert text.strip(), f"client {name}: empty answer"
        assert finish in ("stop", "length"), f"client {name}: stream ended without a finish reason"
    # one model, one context: the server runs one generation at a time, so one stream's chunks all
    # come before the other's (the first chunk, the role, is sent when generation starts)
    first, second = sorted(("a", "b"), key=lambda n: times[n][0])
    print(f"\nfirst {first}: {results[first][0]!r}\nsecond {second}: {results[second][0]!r}")
    assert times[first][-1] <= times[second][1]


def test_client_disconnecting_mid_stream(client, server):
    stream = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Count to fifty."}],
                                            max_tokens=200, temperature=0.0, stream=True)
    n = 0
    for _ in stream:
        n += 1
        if n == 3:
            break
    stream.close()  # drops the connection while the server is generating
    assert server["proc"].poll() is None
    text, finish = _stream_chat(client)  # the next request is served in full
    assert text.strip() and finish in ("stop", "length")


def test_bad_request_body_is_a_4xx_with_a_message(client, server):
    with pytest.raises(openai.APIStatusError) as ei:
        client.chat.completions.create(model="any", messages=[{"role": "nobody", "content": 3}], max_tokens=4)
    assert 400 <= ei.value.status_code < 500
    assert "messages" in str(ei.value.body)
    req = urllib.request.Request(server["base"] + "/v1/completions", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=30)
    assert 400 <= ei.value.code < 500 and "JSON" in json.loads(ei.value.read())["error"]["message"]
    assert server["proc"].poll() is None


# ---- a mixture-of-experts model -------------------------------------------------------------

# a request for every endpoint of the application (method, path) -> JSON body (None: a GET), and
# what its answer must hold; a new endpoint without a request here fails the coverage check
MOE_REQUESTS = {
    ("POST", "/v1/completions"): {"prompt": "abc abc abc", "max_tokens": 6, "temperature": 0.0},
    ("POST", "/v1/engines/copilot-codex/completions"): {"prompt": "abc abc abc", "max_tokens": 6, "temperature": 0.0},
    ("POST", "/v1/chat/completions"): {"messages": MESSAGES, "max_tokens": 6, "temperature": 0.0},
    ("POST", "/v1/embeddings"): {"input": "abc def"},
    ("GET", "/v1/models"): None,
    ("POST", "/extras/tokenize"): {"input": "abc def"},
    ("POST", "/extras/tokenize/count"): {"input": "abc def"},
    ("POST", "/extras/detokenize"): {"tokens": [260, 111]},
    ("GET", "/leanstream/stats"): None,
}


def _routes(app) -> set[tuple[str, str]]:
    """(method, path) of every endpoint: the OpenAPI schema's, and those it hides that the
    server's request check knows (their /v1/engines/copilot-codex/completions alias)."""
    out = {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops}
    for mw in app.user_middleware:
        out |= {("POST", p) for p in mw.kwargs.get("models", {})}
    return out


def _moe_budget(model) -> int:
    """5 experts' bytes: fewer than a layer's 8, so the endpoints' passes read experts."""
    from leanstream_ggml.model import manifest

    return 5 * manifest.load(model).moe.layers[0].expert_stride


@pytest.fixture(scope="module")
def moe_app(tiny_moe):
    """The server's application on the tiny MoE model (embeddings on, so every endpoint answers),
    streaming its experts under a small budget, and a client in this process."""
    from fastapi.testclient import TestClient
    from llama_cpp.server.settings import ModelSettings

    from leanstream_ggml.commands.server import create_app

    _, model = tiny_moe
    settings = ModelSettings(model=str(model), n_ctx=256, n_threads=2, n_threads_batch=2, embedding=True,
                             verbose=False)
    app = create_app(model, model_settings=settings, memory_budget=_moe_budget(model))
    with TestClient(app) as client:
        yield app, client


def test_every_endpoint_answers_on_a_moe_model(moe_app, tiny_moe):
    app, client = moe_app
    assert _routes(app) == set(MOE_REQUESTS)
    got = {}
    for (method, path), body in MOE_REQUESTS.items():
        r = client.request(method, path, json=body)
        assert r.status_code == 200, (path, r.text[:500])
        got[path] = r.json()
    for path in ("/v1/completions", "/v1/engines/copilot-codex/completions"):
        assert got[path]["object"] == "text_completion" and got[path]["usage"]["completion_tokens"] > 0
    texts = {got[p]["choices"][0]["text"] for p in ("/v1/completions", "/v1/engines/copilot-codex/completions")}
    assert len(texts) == 1     # the alias is the same completion (greedy, each from an empty context)
    chat = got["/v1/chat/completions"]
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] > 0
    assert got["/v1/embeddings"]["data"] and got["/v1/models"]["data"][0]["id"] == str(tiny_moe[1])
    assert got["/extras/tokenize/count"]["count"] == len(got["/extras/tokenize"]["tokens"]) > 0
    assert isinstance(got["/extras/detokenize"]["text"], str)
    stats = got["/leanstream/stats"]
    assert stats["loaded"] and stats["stats"]["op_calls"] > 0 and stats["stats"]["blocks_read"] > 0


def test_leanstream_stats_on_a_moe_model(moe_app, tiny_moe):
    """/leanstream/stats answers as on a dense model: the settings, the engine's params and the
    counters every engine shares, which a streamed chat answer moves."""
    from leanstream_ggml.native.engine import COMMON_STATS

    _, client = moe_app
    before = client.get("/leanstream/stats").json()
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": MESSAGES, "max_tokens": 6, "temperature": 0.0, "stream": True}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2
    after = client.get("/leanstream/stats").json()
    assert set(after) == {"model", "loaded", "mode", "sparsity", "memory_budget", "params", "stats", "memory_plan"}
    assert after["mode"] == "dense" and after["sparsity"] == 0.0 and after["memory_plan"] is None
    assert after["memory_budget"] == _moe_budget(tiny_moe[1]) and after["params"]["n_io_threads"] > 0
    s = after["stats"]
    assert set(COMMON_STATS) <= set(s) and s["tokens"] > before["stats"]["tokens"]
    assert s["cache_bytes"] <= s["cache_capacity"] <= after["memory_budget"]


@pytest.mark.slow
def test_leanstream_serve_on_a_moe_model(tiny_moe, tmp_path):
    """The command itself in its own process (its flags, uvicorn), spoken to with the OpenAI client."""
    _, model = tiny_moe
    port = _free_port()
    proc, cg, _ = serve_load.start_server(str(model), port, str(_moe_budget(model)), 256, None, tmp_path / "log")
    base = f"http://127.0.0.1:{port}"
    try:
        serve_load.wait_up(base, proc, tmp_path / "log", timeout_s=START_TIMEOUT_S)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
        text, finish = _stream_chat(client, max_tokens=8)
        assert finish in ("stop", "length")
        stats = _get_json(base + "/leanstream/stats")
        assert stats["memory_budget"] == _moe_budget(model) and stats["stats"]["op_calls"] > 0
    finally:
        serve_load.stop_server(proc, cg)
