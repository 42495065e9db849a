"""The time of a speculative draft step, split into its parts, for several draft fractions.

    python bench/draft_step.py MODEL_DIR --memory-limit 1000MB [--fractions 1,0.5,0.3,0.2] [--steps 24]

The engine gets the budget the memory plan gives it under the limit (no cgroup: the split is of
compute, not of memory pressure). After a chat prompt, the draft decodes --steps tokens of its
own greedy continuation one at a time (what a draft step is: llama_decode of one token with the
draft FFN and the draft's output projection), timed; then the same with the FFN left out
(fraction 0.001: attention, the output projection and the per-step work remain) and with the
draft vocabulary cut to one token (the output projection left out too). Per fraction: the median
step, the FFN ops' time inside it (the engine's draft_ns), and by difference the output
projection and the rest. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PROMPT = "Explain how a hash map handles collisions, with a short Python example."


def steps(llm, n: int, fraction: float) -> tuple[float, float]:
    """(median seconds of a draft step, mean seconds of its FFN ops) over n steps after the
    context, each decoding the draft's own top token; the context is restored after."""
    eng = llm.engine
    n_past, tok = llm.n_tokens, int(llm.input_ids[llm.n_tokens - 1])
    llm.rewind(n_past - 1)
    eng.set_draft(True, fraction)
    total = []
    skip = min(2, n - 1)   # the first steps warm caches
    try:
        for i in range(n):
            if i == skip:
                s0 = eng.stats()["draft_ns"]   # (outside the timed steps: stats() is not free)
            t0 = time.perf_counter()
            llm.eval([tok])
            ids, _ = eng.draft_top(0, 1)
            total.append(time.perf_counter() - t0)
            tok = int(ids[0]) if len(ids) else tok
        ffn = (eng.stats()["draft_ns"] - s0) / 1e9 / (n - skip)
    finally:
        eng.set_draft(False)
        llm.rewind(n_past - 1)
        llm.eval([int(llm.input_ids[n_past - 1])])
    return statistics.median(total[skip:]), ffn


def main(argv=None) -> int:
    from leanstream_ggml import Llama, memplan, options
    from leanstream_ggml.model import manifest
    from leanstream_ggml.native import params

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    options.add_flags(ap, options.SCRIPT, names=("memory_limit",))
    ap.add_argument("--fractions", default="1,0.5,0.3,0.2")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    m = manifest.load(args.model)
    budget = None
    if args.memory_limit:
        budget = memplan.plan(args.model, m, params.size_bytes(args.memory_limit, "memory_limit"), mode="dense").budget
    llm = Llama(args.model, n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, verbose=False,
                speculative="self", **({"memory_budget": budget} if budget else {}))
    try:
        toks = llm.tokenize(PROMPT.encode(), add_bos=True)
        llm.eval(toks)
        rows = []
        for f in [float(x) for x in args.fractions.split(",")]:
            step, ffn = steps(llm, args.steps, f)
            rows.append({"fraction": f, "step_ms": 1e3 * step, "ffn_ms": 1e3 * ffn})
        no_ffn, _ = steps(llm, args.steps, 0.001)
        vocab = llm.draft_vocab()
        llm.engine.set_draft_vocab([int(vocab[0]) if vocab is not None else 0])
        try:
            bare, _ = steps(llm, args.steps, 0.001)
        finally:
            llm.engine.set_draft_vocab(vocab if vocab is not None else [])
        for r in rows:
            r["head_ms"] = 1e3 * (no_ffn - bare)
            r["rest_ms"] = r["step_ms"] - r["ffn_ms"] - r["head_ms"]
        doc = {"model": args.model, "memory_limit": args.memory_limit, "memory_budget": budget,
               "draft_vocab": None if vocab is None else len(vocab), "no_ffn_ms": 1e3 * no_ffn,
               "no_ffn_no_head_ms": 1e3 * bare, "fractions": rows}
    finally:
        llm.close()
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
