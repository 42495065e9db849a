"""Load test of `leanstream serve`: concurrent streaming clients for a while, under a whole-process
memory limit, with requests that are good, cut short by their client, or bad.

    python bench/serve_load.py MODEL_DIR [--clients 4] [--minutes 2] [--memory-limit 600MB]
                               [--memory-budget 64MiB] [--n-ctx 1024] [--seed 0] [--out FILE]

The server runs in its own process inside a child memory cgroup (leanstream_tools.cgroup;
without one the run says so and has no limit), with --interrupt_requests false and 2 threads.
Every good request (chat or completion, prompts of 10 to ~600 tokens, greedy) is first sent
once with the server otherwise idle: that answer is "alone". Then --clients threads (the
official OpenAI client) send requests drawn at random until --minutes have passed: good ones
(streamed or not), ones whose client disconnects after a few chunks, prompts longer than n_ctx,
and absurd max_tokens. Prints one JSON object: requests by outcome, how many completed answers
equal their alone answer (greedy: must be all), 4xx/5xx by cause, latency p50/p95 of completed
good requests, completion tokens per second, the cgroup's peak memory against the limit, OOM
kills, and whether the server was still up at the end.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import benchkit

from leanstream_ggml.cli import command_line

PARAGRAPH = ("The committee reviewed the proposal in detail and asked the authors to explain how the "
             "measurements were taken, which baselines were used, and whether the results hold on other "
             "hardware. ")
QUESTIONS = ["Name three primary colors.", "What is a hash table?", "Write a haiku about rain.",
             "Explain recursion to a child.", "List four planets.", "What does a compiler do?"]


def good_requests() -> list[dict]:
    """The good requests: (kind, body) with greedy sampling; prompts of 10 to ~600 tokens."""
    out = []
    for i, q in enumerate(QUESTIONS):
        out.append({"kind": "chat", "messages": [{"role": "user", "content": q}], "max_tokens": 16 + 8 * (i % 3)})
    for n in (2, 8, 24):   # long prompts: PARAGRAPH is ~35 tokens
        out.append({"kind": "completion", "prompt": PARAGRAPH * n + "In short,", "max_tokens": 24})
        out.append({"kind": "chat", "messages": [{"role": "user", "content": PARAGRAPH * n + "Summarize."}],
                    "max_tokens": 24})
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, port: int, memory_budget: str | None, n_ctx: int, limit: int | None, log: Path,
                 launcher: list[str] | None = None, extra_args: list[str] | None = None):
    """The server process (in a new cgroup with the limit where possible): (proc, cgroup or None, why).
    launcher: the command that runs `leanstream` (default: this interpreter's leanstream_ggml.cli)."""
    from leanstream_ggml.options import BY_NAME
    from leanstream_tools import cgroup

    cmd = [*(launcher or command_line()), "serve", model_dir, "--port", str(port),
           "--n_ctx", str(n_ctx), "--n_threads", "2", "--n_threads_batch", "2", "--interrupt_requests", "false",
           "--verbose", "false"]
    if memory_budget:
        cmd += [BY_NAME["memory_budget"].flag, memory_budget]
    cmd += extra_args or []
    cg, why = None, None
    if limit:
        try:
            cg = cgroup.MemoryCgroup.create(limit)
        except cgroup.CgroupUnavailable as e:
            why = str(e)
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=cg.enter_self if cg else None)
    return proc, cg, why


def wait_up(base: str, proc, log: Path, timeout_s: float = 180, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(urllib.request.Request(base + "/v1/models", headers=headers or {}), timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not up after {timeout_s} s:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.5)


def stop_server(proc, cg) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
    if cg is not None:
        cg.remove()


def ask(client, req: dict, stream: bool, cut_after: int | None = None) -> tuple[str, str | None, int]:
    """(text, finish_reason, chunks) of one greedy request; cut_after: close the stream after that
    many chunks (the client disconnects)."""
    kw = dict(model="any", max_tokens=req["max_tokens"], temperature=0.0)
    if req["kind"] == "chat":
        call = lambda **k: client.chat.completions.create(messages=req["messages"], **k)  # noqa: E731
        piece = lambda c: c.choices[0].delta.content if stream else c.choices[0].message.content  # noqa: E731
    else:
        call = lambda **k: client.completions.create(prompt=req["prompt"], extra_body={"repeat_penalty": 1.0}, **k)  # noqa: E731
        piece = lambda c: c.choices[0].text  # noqa: E731
    if not stream:
        r = call(**kw)
        return piece(r) or "", r.choices[0].finish_reason, 1
    text, finish, n = [], None, 0
    s = call(stream=True, **kw)
    for chunk in s:
        n += 1
        if chunk.choices:
            text.append(piece(chunk) or "")
            finish = chunk.choices[0].finish_reason or finish
        if cut_after is not None and n >= cut_after:
            s.close()
            return "".join(text), "disconnected", n
    return "".join(text), finish, n


def run(model_dir: str, *, clients: int = 4, minutes: float = 2.0, memory_limit: str | None = "600MB",
        memory_budget: str | None = "64MiB", n_ctx: int = 1024, seed: int = 0, log_dir: str | None = None) -> dict:
    import openai

    from leanstream_ggml.native.params import size_bytes

    limit = size_bytes(memory_limit, "memory_limit") or None
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(log_dir or "/tmp") / f"serve_load-{os.getpid()}.log"
    proc, cg, no_cgroup = start_server(model_dir, port, memory_budget, n_ctx, limit, log)
    peak = {"bytes": 0}
    stop = threading.Event()

    def watch():   # the cgroup's own peak is the authority; sampled usage is a cross-check
        while not stop.wait(0.5):
            if cg is not None:
                peak["bytes"] = max(peak["bytes"], cg.stats().get("usage_bytes", 0))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        wait_up(base, proc, log)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=600, max_retries=0)
        goods = good_requests()
        alone = [ask(client, r, stream=False)[0] for r in goods]
        long_prompt = {"kind": "completion", "prompt": PARAGRAPH * (n_ctx // 20), "max_tokens": 8}
        absurd = {"kind": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10 ** 9}
        lock = threading.Lock()
        outcomes: dict[str, int] = {}
        errors: dict[str, int] = {}
        latencies, chars_out, mismatches = [], [0], []
        deadline = time.monotonic() + 60 * minutes

        def count(key: str, table=outcomes):
            with lock:
                table[key] = table.get(key, 0) + 1

        def client_loop(ci: int):
            rng = random.Random(seed * 1000 + ci)
            c = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=600, max_retries=0)
            while time.monotonic() < deadline:
                roll = rng.random()
                try:
                    if roll < 0.1:
                        ask(c, long_prompt, stream=rng.random() < 0.5)
                        count("bad request answered 2xx")
                    elif roll < 0.2:
                        ask(c, absurd, stream=rng.random() < 0.5)
                        count("bad request answered 2xx")
                    elif roll < 0.3:
                        i = rng.randrange(len(goods))
                        ask(c, goods[i], stream=True, cut_after=rng.randint(1, 4))
                        count("disconnected by its client")
                    else:
                        i = rng.randrange(len(goods))
                        t0 = time.monotonic()
                        text, finish, _ = ask(c, goods[i], stream=rng.random() < 0.7)
                        dt = time.monotonic() - t0
                        with lock:
                            latencies.append(dt)
                            chars_out[0] += len(text)
                            if text != alone[i]:
                                mismatches.append({"request": i, "alone": alone[i], "under_load": text})
                        count("completed")
                except openai.APIStatusError as e:
                    msg = str(e.body.get("message") if isinstance(e.body, dict) else e.body)[:80]
                    count(f"{e.status_code}", errors)
                    count(f"{e.status_code}: {msg}", errors)
                    count("4xx" if 400 <= e.status_code < 500 else "5xx")
                except openai.APIError as e:   # an error event in a stream
                    count(f"stream error: {str(e)[:80]}", errors)
                    count("stream error")
                except (openai.APIConnectionError, openai.APITimeoutError) as e:
                    count(f"connection: {type(e).__name__}", errors)
                    count("connection error")

        t_start = time.monotonic()
        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t_start
        stats = json.loads(urllib.request.urlopen(base + "/leanstream/stats", timeout=30).read())
        alive = proc.poll() is None
    finally:
        stop.set()
        cg_stats = cg.stats() if cg is not None else {}
        stop_server(proc, cg)
    completed = outcomes.get("completed", 0)
    lat = sorted(latencies)
    return {
        "model": model_dir, "clients": clients, "minutes": minutes, "n_ctx": n_ctx, "memory_budget": memory_budget,
        "memory_limit_bytes": limit if cg is not None else None, "no_cgroup": no_cgroup,
        "peak_memory_bytes": cg_stats.get("max_usage_bytes", peak["bytes"]) if cg is not None else None,
        "oom_kills": cg_stats.get("oom_kill"), "limit_hits": cg_stats.get("failcnt"),
        "outcomes": outcomes, "errors": errors, "completed": completed,
        "identical_to_alone": (completed - len(mismatches)) / completed if completed else None,
        "mismatches": mismatches[:5],
        "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
        "latency_p95_s": round(lat[int(0.95 * (len(lat) - 1))], 3) if lat else None,
        "requests_per_s": round(completed / wall, 3), "answer_chars_per_s": round(chars_out[0] / wall, 1),
        "decoded_tokens": stats["stats"]["tokens"], "server_alive_at_end": alive, "wall_s": round(wall, 1),
    }


def main() -> int:
    ap = benchkit.parser(__doc__)
    ap.add_argument("model_dir")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=2.0)
    from leanstream_ggml.options import add_flags

    add_flags(ap, "serve_load", ("memory_limit", "memory_budget"))   # defaults 600MB, 64MiB
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()
    return benchkit.emit(run(a.model_dir, clients=a.clients, minutes=a.minutes, memory_limit=a.memory_limit,
                             memory_budget=a.memory_budget, n_ctx=a.n_ctx, seed=a.seed), a.out)


if __name__ == "__main__":
    sys.exit(main())
