"""`leanstream serve` end to end: llama-cpp-python's server application with the plugin's Llama
inside, in its own process, spoken to over real HTTP on 127.0.0.1 with the official OpenAI client.

The server runs with --interrupt_requests false (llama-cpp-python's default, true, ends a stream
early when another request arrives; both behaviours are theirs) and 2 threads, so its output is
comparable token for token with an in-process Llama on the same directory. Every wait is
bounded; the server process is killed at the end of the module.
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

pytestmark = pytest.mark.slow

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
