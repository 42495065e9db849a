"""Decode speed with other processes busy on every core, against the same decode on a quiet
machine (interleaved rounds), and whether the answer stays the same.

    python bench/contention.py MODEL_DIR [--mode dense] [--memory-budget 64MiB] [--busy 0 1 3]
                               [--tokens 48] [--rounds 3] [--threads 2]

--busy N: N busy-looping processes per core while the decode runs (N = 1: two runnable threads
per core, ours and one other; the fair share is one half). Greedy decode of --tokens tokens after
a short prompt; the rate is over the tokens after the first (prefill excluded). Prints one JSON
object: per busy level the decode tok/s of every round, the median, its ratio to the quiet
median, and whether every answer equals the quiet one token for token.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import benchkit

PROMPT = "Explain in a few sentences how a hash table handles collisions."
BUSY = "while True:\n    pass\n"


def decode(llm, n_tokens: int) -> tuple[str, float]:
    out, t_first = [], None
    for chunk in llm.create_completion(PROMPT, max_tokens=n_tokens, temperature=0.0, stream=True):
        if t_first is None:
            t_first = time.perf_counter()
        out.append(chunk["choices"][0]["text"])
    t_end = time.perf_counter()
    return "".join(out), (len(out) - 1) / (t_end - t_first) if len(out) > 1 else 0.0


def with_busy(n_per_core: int, fn):
    cores = len(os.sched_getaffinity(0))
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n_per_core * cores)]
    try:
        time.sleep(0.2 if procs else 0)   # let them reach the loop
        return fn()
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def main() -> int:
    ap = benchkit.parser(__doc__)
    ap.add_argument("model_dir")
    benchkit.flags(ap, "mode", "memory_budget")
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if 0 not in a.busy:
        a.busy = [0] + a.busy

    from leanstream_ggml import Llama

    llm = Llama(a.model_dir, mode=a.mode, memory_budget=a.memory_budget, n_ctx=256, n_threads=a.threads,
                n_threads_batch=a.threads, verbose=False)
    try:
        decode(llm, 4)   # warm: blocks resident (or the cache filled), pages touched
        rates = {n: [] for n in a.busy}
        answers = {n: [] for n in a.busy}
        for _ in range(a.rounds):
            for n in a.busy:
                text, rate = with_busy(n, lambda: decode(llm, a.tokens))
                rates[n].append(rate)
                answers[n].append(text)
    finally:
        llm.close()
    quiet = statistics.median(rates[0])
    print(json.dumps({
        "model": a.model_dir, "mode": llm.mode, "memory_budget": a.memory_budget, "tokens": a.tokens,
        "threads": a.threads, "cores": len(os.sched_getaffinity(0)),
        "levels": {f"busy_per_core={n}": {"tok_s": [round(r, 2) for r in rates[n]],
                                          "median_tok_s": round(statistics.median(rates[n]), 2),
                                          "ratio_to_quiet": round(statistics.median(rates[n]) / quiet, 3),
                                          "same_answer": all(t == answers[0][0] for t in answers[n])}
                   for n in a.busy},
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
