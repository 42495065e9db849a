"""The streaming controller against fixed settings: a grid over the same knobs, interleaved.

    python bench/controller.py MODEL_DIR --regimes 35%,1000MB --contend 0,1 \
        --configs off,table,fixed:0,...,fixed:8 --rounds 2 --out bench/results/controller-....json
    python bench/controller.py MODEL_DIR --regimes 1000MB --slowdown --out ...   # the disk slows mid-run

A regime is a budget: "35%" (a share of the FFN on disk, the engine's budget), "1000MB" (a
whole-process limit: each run in its own memory cgroup of that size, the engine's budget from the
memory plan) or "budget=415MB" (the engine's budget, no cgroup: --ppl at a limit's budget, since
logits_all's buffers are not in the memory plan). --contend 1 runs the regime beside a second process that streams the model's
base.gguf with O_DIRECT reads of 1 MiB (leanstream_tools.tune.DiskReader). A config is "off"
(today's fixed default: the parameters as given), "table" (the tuned policy for that budget) or
"fixed:K" (action K of the tuned policy's actions on every layer); "dense" is plugin dense. A
config may end in "@ioN": the engine with N I/O threads (reads in flight) instead of its default.

Every run is a fresh process: a prompt, --warmup decoded tokens (the cache fills), then --tokens
decoded tokens of the bundled held-out code, teacher-forced, timed. Per round every (regime,
contention, config) runs once, back to back. Prints one JSON document: the runs, and per regime
the median tok/s of every config, its ratio to "off", the best fixed config and table / best.

--slowdown: one table run of 2 x --tokens tokens whose second half runs beside the reader; the
controller's recorded decisions per half (state and action histograms) and the disk measure.
--ppl: decode-scored perplexity (held-out code, the domain sparsity costs most; 256-token window,
second half scored) of each --configs entry per regime, quiet ("dense" for the reference).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import benchkit

PROMPT = "def merge_sorted(a, b):\n"


def llama_kwargs(model_dir: Path, regime: str) -> dict:
    from leanstream_ggml.model import manifest as mf

    if regime.endswith("%"):
        m = mf.load(model_dir)
        ffn = sum((model_dir / e.file).stat().st_size for e in m.layers)
        return {"memory_budget": int(ffn * float(regime[:-1]) / 100)}
    if regime.startswith("budget="):
        return {"memory_budget": regime.split("=", 1)[1]}
    return {"memory_limit": regime}


def engine_kwargs(a: dict) -> dict:
    """Llama's engine keywords for run a: the regime's budget, the mode and controller of its
    config ("dense", else leanstream with that controller), "@ioN" as n_io_threads, the sparsity."""
    kw = llama_kwargs(Path(a["model"]), a["regime"])
    config, sep, io = a["config"].partition("@io")
    if sep:
        if not io.isdigit() or int(io) < 1:
            raise SystemExit(f"bad config {a['config']!r}: the suffix is @ioN with N >= 1 I/O threads")
        kw["n_io_threads"] = int(io)
    from leanstream_ggml.native import modes

    if config == modes.DEFAULT:      # "dense": the plugin's dense mode, the reference
        return {**kw, "mode": modes.DEFAULT}
    kw.update(mode=modes.QUALITY, controller=config)
    if a.get("sparsity") is not None:
        kw["sparsity"] = a["sparsity"]
    return kw


def child(a: dict) -> dict:
    """One run (in this process): the decode rate and what the engine did."""
    import numpy as np

    from leanstream_ggml import Llama
    from leanstream_tools.bench import DEFAULT_TEXT
    from leanstream_tools.tune import DiskReader, text_tokens

    model_dir = Path(a["model"])
    llm = Llama(str(model_dir), n_ctx=512, n_threads=a["threads"], n_threads_batch=a["threads"], verbose=False,
                **engine_kwargs(a))
    try:
        text = DEFAULT_TEXT.with_name("heldout-code.txt")
        n = a["tokens"] * (2 if a.get("slowdown") else 1)
        cont = text_tokens(llm, text, a["warmup"] + n)
        llm.eval(llm.tokenize(PROMPT.encode()))
        for t in cont[:a["warmup"]]:
            llm.eval([t])
        if a.get("slowdown"):
            pol = llm.controller_policy
            llm.engine.set_controller("table", actions=pol.actions, load_edges=pol.load_edges,
                                      disk_edges=pol.disk_edges, table=pol.table, record=True)
        llm.reset_stats()
        reader = DiskReader(llm.manifest.resolve(model_dir, llm.manifest.base.file)) if a["contend"] else None
        halves = []
        if reader:
            reader.__enter__()
        try:
            t0 = time.perf_counter()
            for i, t in enumerate(cont[a["warmup"]:]):
                if a.get("slowdown") and i == a["tokens"]:
                    halves.append((time.perf_counter() - t0, llm.engine.controller_samples()))
                    reader = DiskReader(llm.manifest.resolve(model_dir, llm.manifest.base.file)).__enter__()
                    t0 = time.perf_counter()
                llm.eval([t])
            dt = time.perf_counter() - t0
        finally:
            if reader:
                reader.__exit__(None, None, None)
        s = llm.stats()
        out = {"decode_tps": a["tokens"] / dt, "mb_read_per_token": s["bytes_read"] / max(1, s["tokens"]) / 1e6,
               "reads_per_token": s["reads_per_token"], "memory_budget": llm.engine.memory_budget,
               "cache_mb": s["cache_capacity"] / 1e6, "bridge_kib": s["bridge_bytes"] / 1024,
               "io_stall_share": s["io_stall_ns"] / max(1, s["op_ns"] * a["threads"])}
        if "controller" in s:
            out["decisions"] = s["controller"]["decisions"]
            out["ctrl_ns_per_decision"] = s["controller"]["ns_per_decision"]
        if a.get("slowdown"):
            pol = llm.controller_policy
            halves.append((dt, llm.engine.controller_samples()))
            out["halves"] = []
            for (secs, smp), name in zip(halves, ("quiet", "reader on")):
                h = {"phase": name, "decode_tps": a["tokens"] / secs,
                     "disk_ns_per_mib_median": float(np.median(smp["disk_ns_per_mib"])) if len(smp["seq"]) else None,
                     "disk_state_share": [float(np.mean(smp["disk_state"] == d)) for d in range(pol.n_disk)],
                     "load_state_share": [float(np.mean(smp["load_state"] == q)) for q in range(pol.n_load)],
                     "action_share": {f"{c:g}/{b:g}": float(np.mean(smp["action"] == k))
                                      for k, (c, b) in enumerate(pol.actions)}}
                out["halves"].append(h)
        return out
    finally:
        llm.close()


def child_ppl(a: dict) -> dict:
    import numpy as np

    from leanstream_ggml import Llama
    from leanstream_tools.bench import DEFAULT_TEXT
    from leanstream_ggml.scoring import window_logits, window_nll
    from leanstream_tools.tune import text_tokens

    model_dir = Path(a["model"])
    llm = Llama(str(model_dir), n_ctx=264, n_batch=264, logits_all=True, n_threads=a["threads"],
                n_threads_batch=a["threads"], verbose=False, **engine_kwargs(a))
    try:
        toks = [llm.token_bos()] + text_tokens(llm, DEFAULT_TEXT.with_name(a.get("text", "heldout-code.txt")), 256)
        return {"ppl": float(np.exp(np.mean(window_nll(window_logits(llm, toks, decode=True), toks))))}
    finally:
        llm.close()


def run(a: dict, timeout_s: float = 1800) -> dict:
    """One run in a fresh process; in a memory cgroup for a whole-process regime."""
    return benchkit.run_child(__file__, a, limit_bytes=benchkit.regime_limit(a["regime"]), timeout_s=timeout_s)[0]


def main(argv=None) -> int:
    ap = benchkit.parser(__doc__, child=True)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--regimes", default="35%,1000MB")
    ap.add_argument("--contend", default="0,1")
    ap.add_argument("--configs", default="off,table," + ",".join(f"fixed:{k}" for k in range(9)))
    benchkit.flags(ap, "sparsity")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slowdown", action="store_true")
    ap.add_argument("--ppl", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.child:
        return benchkit.answer_child(args.child, lambda a: child_ppl(a) if a.get("ppl") else child(a))
    base = {"model": args.model, "threads": args.threads, "warmup": args.warmup, "tokens": args.tokens,
            "sparsity": args.sparsity}
    regimes = args.regimes.split(",")
    contends = [int(x) for x in args.contend.split(",")]
    configs = args.configs.split(",")
    doc = {"model": args.model, "args": vars(args), "runs": []}
    if args.slowdown:
        for regime in regimes:
            r = run({**base, "regime": regime, "config": "table", "contend": 0, "slowdown": True})
            r.update(regime=regime)
            print(json.dumps(r), file=sys.stderr, flush=True)
            doc["runs"].append(r)
    elif args.ppl:
        for regime in regimes:
            for config in configs:
                r = run({**base, "regime": regime, "config": config, "contend": 0, "ppl": True})
                r.update(regime=regime, config=config)
                print(json.dumps(r), file=sys.stderr, flush=True)
                doc["runs"].append(r)
    else:
        for rnd in range(args.rounds):
            for regime in regimes:
                for contend in contends:
                    for config in configs:
                        r = run({**base, "regime": regime, "config": config, "contend": contend})
                        r.update(regime=regime, contend=contend, config=config, round=rnd)
                        print(json.dumps(r), file=sys.stderr, flush=True)
                        doc["runs"].append(r)
        doc["summary"] = summarize(doc["runs"])
    return benchkit.emit(doc, args.out)


def summarize(runs: list[dict]) -> list[dict]:
    out = []
    for regime in dict.fromkeys(r["regime"] for r in runs):
        for contend in sorted({r["contend"] for r in runs if r["regime"] == regime}):
            rs = [r for r in runs if r["regime"] == regime and r["contend"] == contend and "error" not in r]
            med = {}
            for c in dict.fromkeys(r["config"] for r in rs):
                med[c] = statistics.median(r["decode_tps"] for r in rs if r["config"] == c)
            fixed = {c: v for c, v in med.items() if c.startswith("fixed:")}
            best = max(fixed, key=fixed.get) if fixed else None
            row = {"regime": regime, "contend": contend, "median_tps": med,
                   "ratio_to_off": {c: v / med["off"] for c, v in med.items()} if med.get("off") else None,
                   "best_fixed": best}
            if best and "table" in med:
                row["table_over_best_fixed"] = med["table"] / fixed[best]
            out.append(row)
    return out


if __name__ == "__main__":
    sys.exit(main())
