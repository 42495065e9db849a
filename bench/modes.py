"""Decode speed of every engine mode at several FFN budgets and sparsities (issue: the streamed
sparse FFN). One process; each configuration gets a fresh Llama over the same model directory.

    python bench/modes.py MODEL_DIR [--budgets 0.1,0.25,0.5,1.0] [--sparsity 0.5 0.8]
        [--mode dense oneshot dejavu+ powerinfer2 leanstream] [--tokens 24] [--repeats 3]
        [--stock SOURCE.gguf [--perplexity]] [--out results.json] [--plot results.png]

Budgets are fractions of the model's FFN bytes on disk. Block reads use O_DIRECT, so the page
cache does not hide them: "bytes read per token" is real disk traffic. Before timing, each
configuration decodes a short greedy continuation and checks it is text (and, for dense, that
it equals a stock llama-cpp-python continuation when the stock GGUF is given with --stock).
Prints one JSON object. A configuration whose budget cannot hold one layer's working set is
reported as "budget too small", not run. Decode speed is timed on real text, teacher-forced
(every token differs, as in generation). --perplexity adds the decode-scored perplexity of every
(mode, sparsity) against stock: the price of the speed.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import benchkit
from leanstream_ggml.native import modes as engine_modes  # (the engine's modes: what each one does)

PROMPT = "The main differences between a process and a thread are"


def decode_tps(llm, n_tokens: int, offset: int = 0) -> float:
    """Prefill a prompt, then decode n_tokens of real text one at a time (teacher-forced: every
    token differs, as in generation, so the cache sees a realistic stream of selections)."""
    from leanstream_tools.bench import DEFAULT_TEXT

    llm.reset()
    toks = llm.tokenize(PROMPT.encode())
    text = llm.tokenize(DEFAULT_TEXT.read_text(encoding="utf-8").encode(), add_bos=False)
    cont = text[offset: offset + n_tokens]
    llm.eval(toks)
    t0 = time.perf_counter()
    for tok in cont:
        llm.eval([tok])
    return len(cont) / (time.perf_counter() - t0)


def quality(model_dir, mode, sparsity, ref, args) -> dict:
    """Decode-scored perplexity against ``ref`` (stock llama-cpp-python, opened once by the caller)
    on the bundled held-out text (one window of --quality-ctx tokens; its second half is decoded
    token by token, where the sparse modes are sparse). Selection does not depend on the budget,
    so one run per (mode, sparsity)."""
    from leanstream_ggml import Llama
    from leanstream_tools import perplexity
    from leanstream_tools.bench import DEFAULT_TEXT

    n = args.quality_ctx
    kw = dict(n_ctx=n, n_threads=args.threads, n_threads_batch=args.threads, n_batch=n, n_ubatch=n,
              logits_all=True, verbose=False)
    llm = Llama(str(model_dir), mode=mode, sparsity=sparsity if engine_modes.is_sparse(mode) else None, **kw)
    try:
        r = perplexity.compare(llm, ref, DEFAULT_TEXT.read_text(encoding="utf-8"), n, max_chunks=args.quality_chunks,
                               decode=True)
    finally:
        llm.close()
    return {k: r[k] for k in ("ppl", "ppl_reference", "ppl_ratio", "top1_agreement", "kl_mean", "n_scored")}


def run_one(model_dir, mode, budget, sparsity, args, stock_text):
    from leanstream_ggml import Llama
    from leanstream_ggml.native.engine import LeanstreamError

    try:
        llm = Llama(str(model_dir), mode=mode, sparsity=sparsity if engine_modes.is_sparse(mode) else None,
                    memory_budget=budget or None, n_ctx=256, n_threads=args.threads, n_io_threads=args.n_io_threads,
                    hot_fraction=args.hot_fraction,
                    n_threads_batch=args.threads, verbose=False)
    except (LeanstreamError, ValueError) as e:
        return {"error": str(e).splitlines()[0]}
    try:
        text = llm(PROMPT, max_tokens=12, temperature=0.0)["choices"][0]["text"]
        check = {"text": text}
        if not engine_modes.is_sparse(mode) and stock_text is not None:
            check["matches_stock"] = text == stock_text
        tps = []
        for i in range(args.repeats):
            llm.reset_stats()
            tps.append(decode_tps(llm, args.tokens, offset=i * args.tokens))
        s = llm.stats()
        nth = args.threads
        return {"decode_tps": statistics.median(tps), "decode_tps_all": tps, "check": check,
                "miss_ratio": s["miss_ratio"], "loading_redundancy": s["loading_redundancy"],
                "bytes_read_per_token": s["bytes_read"] / max(1, args.tokens),
                "io_stall_share": s["io_stall_ns"] / max(1, s["op_ns"] * nth),
                "predictor_us_per_token": s["predictor_ns"] / 1e3 / max(1, args.tokens),
                "cache_bytes": s["cache_bytes"], "cache_capacity": s["cache_capacity"],
                "io_threads": llm.engine.params["n_io_threads"]}
    finally:
        llm.close()


def main(argv=None) -> int:
    ap = benchkit.parser(__doc__)
    ap.add_argument("model_dir", help="converted model directory (or, with --table, a results JSON)")
    ap.add_argument("--table", action="store_true", help="print the markdown tables of a results JSON and exit")
    ap.add_argument("--budgets", default="0.1,0.25,0.5,1.0")
    # every mode at the same pinned share (powerinfer2's and leanstream's with predictors)
    benchkit.flags(ap, "mode", "sparsity", "n_io_threads", "hot_fraction", sweep=("mode", "sparsity"),
                   defaults={"mode": list(engine_modes.MODES), "sparsity": [0.5, 0.8], "hot_fraction": 0.5})
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stock", help="the source GGUF: check dense against stock llama-cpp-python")
    ap.add_argument("--perplexity", action="store_true",
                    help="also measure decode-scored perplexity vs stock per (mode, sparsity) (needs --stock)")
    ap.add_argument("--quality-ctx", type=int, default=256)
    ap.add_argument("--quality-chunks", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    if args.table:
        print(markdown(json.loads(Path(args.model_dir).read_text())))
        return 0
    if args.perplexity and not args.stock:
        ap.error("--perplexity needs --stock GGUF")

    from leanstream_ggml.model import manifest

    m = manifest.load(args.model_dir)
    ffn = m.totals.ffn_bytes_on_disk
    stock_text = None
    if args.stock:
        import llama_cpp

        st = llama_cpp.Llama(args.stock, n_ctx=256, n_threads=args.threads, verbose=False)
        stock_text = st(PROMPT, max_tokens=12, temperature=0.0)["choices"][0]["text"]
        st.close()
    results = []
    for frac in [float(x) for x in args.budgets.split(",") if x]:   # --budgets "": quality only
        budget = 0 if frac >= 1.0 else int(frac * ffn)
        for mode in args.mode:
            for s in (args.sparsity if engine_modes.is_sparse(mode) else [0.0]):
                r = run_one(args.model_dir, mode, budget, s, args, stock_text)
                r.update(mode=mode, sparsity=s, budget_fraction=frac, budget_bytes=budget)
                print(json.dumps({k: r[k] for k in r if k not in ("check", "decode_tps_all")}), file=sys.stderr)
                results.append(r)
    qual = []
    if args.perplexity:
        from leanstream_tools import systems

        n = args.quality_ctx
        ref = systems.open_model(args.stock, "stock", n_ctx=n, n_threads=args.threads, n_batch=n, logits_all=True)
        try:
            for mode in args.mode:
                for s in (args.sparsity if engine_modes.is_sparse(mode) else [0.0]):
                    q = quality(args.model_dir, mode, s, ref, args)
                    q.update(mode=mode, sparsity=s)
                    print(json.dumps(q), file=sys.stderr)
                    qual.append(q)
        finally:
            ref.close()
    doc = {"model_dir": Path(args.model_dir).name,  # no machine paths in results
           "architecture": m.architecture, "ffn_bytes": ffn, "threads": args.threads,
           "io_threads": next((r["io_threads"] for r in results if "io_threads" in r), args.n_io_threads),
           "hot_fraction": args.hot_fraction, "tokens": args.tokens, "repeats": args.repeats,
           "date": time.strftime("%Y-%m-%d"), "results": results, "quality": qual}
    benchkit.emit(doc, args.out)
    if args.plot:
        plot(doc, args.plot)
    return 0


def markdown(doc) -> str:
    """The README tables: decode tok/s (MB read per token) per budget and mode; quality per mode."""
    rs = [r for r in doc["results"]]
    cols = list(dict.fromkeys((r["mode"], r["sparsity"]) for r in rs))
    name = lambda m, s: f"{m} s={s:g}" if engine_modes.is_sparse(m) else m
    out = ["| FFN budget | " + " | ".join(name(*c) for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for frac in sorted({r["budget_fraction"] for r in rs}):
        cells = []
        for m, s in cols:
            r = next((r for r in rs if r["budget_fraction"] == frac and r["mode"] == m and r["sparsity"] == s), None)
            if r is None:
                cells.append("")
            elif "decode_tps" not in r:
                cells.append("budget too small" if "budget" in r.get("error", "") else "error")
            else:
                cells.append(f"{r['decode_tps']:.2f} ({r['bytes_read_per_token'] / 1e6:.0f} MB)")
        out.append(f"| {frac:.0%} | " + " | ".join(cells) + " |")
    if doc.get("quality"):
        out += ["", "| mode | sparsity | perplexity ratio vs stock | top-1 agreement | mean KL |", "|---|---:|---:|---:|---:|"]
        for q in doc["quality"]:
            out.append(f"| {q['mode']} | {q['sparsity']:g} | {q['ppl_ratio']:.3f} | {q['top1_agreement']:.3f} | "
                       f"{q['kl_mean']:.4f} |")
    return "\n".join(out)


def plot(doc, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sps = sorted({r["sparsity"] for r in doc["results"] if engine_modes.is_sparse(r["mode"])}) or [0.0]
    fig, axes = plt.subplots(1, len(sps), figsize=(5 * len(sps), 4), squeeze=False)
    for ax, s in zip(axes[0], sps):
        for mode in dict.fromkeys(r["mode"] for r in doc["results"]):
            pts = [(r["budget_fraction"], r["decode_tps"]) for r in doc["results"]
                   if r["mode"] == mode and (not engine_modes.is_sparse(mode) or r["sparsity"] == s) and "decode_tps" in r]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=mode)
        ax.set_xlabel("FFN budget (fraction of FFN bytes)")
        ax.set_ylabel("decode tok/s")
        ax.set_title(f"sparsity {s}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
