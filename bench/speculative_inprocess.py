"""Speculative configs against plain decoding in one process, warm, prompt by prompt interleaved.

    python bench/speculative_inprocess.py MODEL_DIR --configs off,auto --domains code,chat \
        --prompt-file bench/data/speculative-heldout.json --max-tokens 128 --rounds 2 \
        --out bench/results/speculative-inprocess-....json

In RAM only (no memory limit): every config's ``Llama`` is loaded side by side, and each prompt
is decoded by every config in turn, the order reversed every other prompt, so that a slow minute
of a shared machine falls on all of them. Fresh processes (bench/speculative.py) differ from one
another by ±15 % on 2 shared cores, more than what is compared here; within one process the
configs see the same page cache, the same memory placement and the same clock.

Decode tok/s = (tokens - 1) / (time from the first token to the last), greedy, through
``generate``. Prints one JSON document: per config and domain the tok/s over all prompts, its
ratio to "off", the spread of the per-prompt ratios, whether every answer equals "off"'s token
for token, and the speculative counters.
"""

from __future__ import annotations

import json
import statistics
import sys

import benchkit
from speculative import PROMPTS, chat_prompt_tokens, greedy


def tps(run: dict) -> float:
    return (run["tokens"] - 1) / run["decode_s"]


def main(argv=None) -> int:
    ap = benchkit.parser(__doc__)
    ap.add_argument("model")
    ap.add_argument("--configs", default="off,auto", help="speculative= values; 'off' is the reference")
    ap.add_argument("--domains", default="code,chat")
    ap.add_argument("--prompt-file", default=str(PROMPTS))
    ap.add_argument("--prompts", type=int, default=None, help="prompts per domain (default: all)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    configs = args.configs.split(",")
    if "off" not in configs:
        ap.error("--configs must include off, the reference")
    from leanstream_ggml import Llama
    from leanstream_tools.measure import machine_info

    prompts = json.loads(open(args.prompt_file).read())
    domains = args.domains.split(",")
    kw = dict(n_ctx=args.ctx, n_threads=args.threads, n_threads_batch=args.threads, verbose=False, mode="dense")
    llms = {c: Llama(args.model, speculative=c, **kw) for c in configs}
    runs, k = [], 0
    for r in range(args.rounds):
        for dom in domains:
            for i, text in enumerate(prompts[dom][:args.prompts]):
                order = configs if k % 2 == 0 else configs[::-1]
                k += 1
                for c in order:
                    llms[c].reset()   # (a prompt seen in an earlier round is prefilled again, as in the first)
                    out, _, secs = greedy(llms[c], chat_prompt_tokens(llms[c], text), args.max_tokens)
                    runs.append({"round": r, "domain": dom, "prompt": i, "config": c, "tokens": len(out),
                                 "decode_s": secs or 0.0, "answer": out})
    off = {(x["domain"], x["prompt"], x["round"]): x for x in runs if x["config"] == "off"}
    summary = []
    for dom in domains:
        rows = {}
        for c in configs:
            rs = [x for x in runs if x["domain"] == dom and x["config"] == c]
            rows[c] = {"decode_tps": sum(x["tokens"] - 1 for x in rs) / max(1e-9, sum(x["decode_s"] for x in rs)),
                       "same_answers": all(x["answer"] == off[(dom, x["prompt"], 0)]["answer"] for x in rs)}
        base = rows["off"]["decode_tps"]
        for c in configs:
            rows[c]["ratio_to_off"] = rows[c]["decode_tps"] / base
            per = [tps(x) / tps(off[(dom, x["prompt"], x["round"])]) for x in runs
                   if x["domain"] == dom and x["config"] == c and x["decode_s"] and off[(dom, x["prompt"], x["round"])]["decode_s"]]
            rows[c]["ratio_by_prompt"] = {"min": min(per), "median": statistics.median(per), "max": max(per)}
        summary.append({"domain": dom, "configs": rows})
    for x in runs:
        del x["answer"]
    doc = {"model": args.model, "args": vars(args), "machine": machine_info(), "runs": runs, "summary": summary,
           "speculative": {c: llm.stats().get("speculative") for c, llm in llms.items() if c != "off"}}
    return benchkit.emit(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
