"""What verifying every block's CRC-32C costs in decode (README: "Checksum cost").

    python bench/checksum_cost.py MODEL_DIR --memory-budget 16MiB --tokens 32 --pairs 6

Alternates --pairs times (interleaved, so that load from other work hits both alike): open the
model with checks on, greedy-decode --tokens tokens, close; the same with checks off (one model
open at a time: an idle llama.cpp context's threads would compete with the measured one).
Checks first that both produce the same tokens. Per side it reports the median over pairs of
wall time and process CPU time (all threads: compute, I/O workers) per decoded token, and the
engine's own count of time spent in the checksum (checksum_ns, summed over I/O threads). Prints
one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np

import benchkit


def decode(llm, prompt, n):
    from leanstream_ggml.llamacpp import context

    llm.reset()
    llm.eval(prompt)
    llm.reset_stats()
    tok = int(np.argmax(context.logits(llm)))
    out = []
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        llm.eval([tok])
        out.append(tok)
        tok = int(np.argmax(context.logits(llm)))
    w1, c1 = time.perf_counter(), time.process_time()
    s = llm.stats()
    return out, (w1 - w0) / n, (c1 - c0) / n, s["checksum_ns"] / 1e9 / n, s["bytes_read_per_token"]


def main(argv=None) -> int:
    ap = benchkit.parser(__doc__)
    ap.add_argument("model")
    benchkit.flags(ap, "memory_budget", defaults={"memory_budget": "16MiB"})   # below the FFN: every token reads
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from leanstream_ggml import Llama
    from leanstream_tools.bench import DEFAULT_TEXT

    kw = dict(memory_budget=args.memory_budget, n_ctx=512, n_threads=args.threads,
              n_threads_batch=args.threads, verbose=False)
    res = {True: [], False: []}
    loads = []
    for i in range(args.pairs):
        loads.append(os.getloadavg()[0])
        for v in ((True, False) if i % 2 == 0 else (False, True)):
            llm = Llama(args.model, verify_checksums=v, **kw)
            prompt = llm.tokenize(DEFAULT_TEXT.read_text().encode(), add_bos=True)[:32]
            res[v].append(decode(llm, prompt, args.tokens))
            llm.close()
    assert all(r[0] == res[True][0][0] for v in res for r in res[v]), "checks on/off decode different tokens"
    med = {v: {"wall_s_per_token": statistics.median(r[1] for r in res[v]),
               "cpu_s_per_token": statistics.median(r[2] for r in res[v]),
               "checksum_s_per_token": statistics.median(r[3] for r in res[v]),
               "bytes_read_per_token": res[v][0][4]} for v in res}
    on, off = med[True], med[False]
    print(json.dumps({
        "model": args.model, "memory_budget": args.memory_budget, "tokens": args.tokens, "pairs": args.pairs,
        "threads": args.threads, "on": on, "off": off,
        "wall_ratio_on_off": on["wall_s_per_token"] / off["wall_s_per_token"],
        "cpu_ratio_on_off": on["cpu_s_per_token"] / off["cpu_s_per_token"],
        "checksum_share_of_decode_wall": on["checksum_s_per_token"] / on["wall_s_per_token"],
        "checksum_GB_s": on["bytes_read_per_token"] / on["checksum_s_per_token"] / 1e9,
        "load_avg_1min": loads, "cores": os.cpu_count(),
        "all_wall_on": [r[1] for r in res[True]], "all_wall_off": [r[1] for r in res[False]],
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
