"""Side by side under whole-process memory limits: stock llama-cpp-python vs LeanStream modes.

    python bench/side_by_side.py --model qwen2.5-coder-1.5b-instruct \
        --limits none,1500MB,1200MB,1000MB,900MB --systems stock,dense \
        --out bench/results/side_by_side-qwen2.5-1.5b.json --plot bench/results/side_by_side-qwen2.5-1.5b.png

For every memory limit (largest first) and every system (interleaved, so all systems of one
limit run back to back under the same machine conditions):

0. the model files are copied to a private temporary directory in the model cache (removed at
   the end), so no other process on a shared machine brings their pages back into the cache;
1. the page cache of that system's model files is dropped (posix_fadvise DONTNEED; what stays
   resident is measured with mincore and recorded);
2. `leanstream bench MODEL --json` runs in a fresh process inside its own child memory cgroup
   (leanstream_tools/cgroup.py: the forked child enters the cgroup before exec, so the
   whole process, page cache of the mmap'd GGUF included, is charged and limited; runs without
   a limit get a cgroup too, for its accounting only);
3. its JSON, the cgroup's peak and OOM counters, and "oom" / "timeout" / "error" are recorded.

Systems: "stock" = llama_cpp.Llama on the GGUF with mmap (llama-cpp-python's defaults);
"stock-<type>" (e.g. stock-q3_k_m, stock-q2_k) = the same on a smaller quantization of the same
model, made with llama.cpp's quantizer from the GGUF given (leanstream_tools/quants.py: a
re-quantization when the source is already quantized) — what a stock user would run at a limit
the original does not fit; any other name is a LeanStream engine mode on the converted model
directory ("dense", "oneshot", "dejavu+", "powerinfer2", "leanstream"). All get the same n_ctx,
n_batch, threads, prompt and lengths.

--perplexity: each system's held-out perplexity too (`leanstream perplexity`, windows of 512,
the bundled held-out text), measured once per system without a limit: a memory limit changes
where the weights are read from, not what is computed (dense streaming is checked equal to stock
below; a quantization's output does not depend on the page cache), so it holds at every limit. A LeanStream run under limit L gets ``memory_budget = L - reserve`` for its FFN weight
cache, and no budget without a limit. The reserve (non-FFN weights, KV cache, compute buffers,
Python) is measured: the same mode's charged peak (cgroup) without a limit minus the bytes its
cache and its resident sketch/predictors held, plus 32 MiB (so include "none" in --limits; otherwise the memory plan's reserve, memplan.py, or
--reserve).

Prints one JSON document; writes it to --out and the plot (decode tok/s vs memory limit, one
line per system: the paper's Fig. 8) to --plot. Where cgroups are not writable it says so in the
JSON and on stderr, and runs each system once without a limit.

The runs themselves (the child process, its cgroup, the page cache, the reserve, the private
copies, the perplexities) are leanstream_tools/compare/'s, which `leanstream compare`
runs at one limit: this script adds the sweep over limits and its plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import benchkit
from benchkit import REPO
from leanstream_tools import cgroup, measure
from leanstream_tools.compare import (
    STOCK, add_greedy_match, bench_run, cgroup_doc, check_setups, child_env, choose_reserve, is_stock, log,
    measure_perplexities, model_doc, parse_systems, prepare_models, stock_files, stock_quant, workspace)


def parse_limits(text: str) -> list[int | None]:
    """"none,1500MB,1.2GB" -> [None, 1500000000, 1200000000], largest first, None (no limit) first."""
    vals = [measure.parse_size(x) for x in text.split(",") if x.strip()]
    uniq = list(dict.fromkeys(vals))
    return sorted(uniq, key=lambda v: (v is not None, -(v or 0)))


def run(args) -> dict:
    systems = check_setups(parse_systems(args.systems))
    limits = parse_limits(args.limits)
    gguf_orig, ggufs_orig, dir_orig = prepare_models(args.model, systems, args.model_dir)
    with workspace(ggufs_orig, dir_orig, args.private_copy) as (ggufs, model_dir):
        doc = _run(args, systems, limits, ggufs, model_dir)
    doc.update(model_path=str(gguf_orig), model_dir=str(dir_orig) if dir_orig else None)
    doc["stock_files"] = stock_files(ggufs_orig, gguf_orig)
    doc["settings"]["private_copy"] = bool(args.private_copy)
    return doc


def _run(args, systems, limits, ggufs: dict, model_dir: Path | None) -> dict:
    """Every system at every limit (largest first, systems interleaved), then the perplexities."""
    gguf = ggufs[STOCK]
    fixed_reserve = measure.parse_size(args.reserve) if args.reserve else None
    reserve_of: dict[str, tuple[int, str]] = {}  # mode -> (reserve bytes, how it was chosen)

    ok, where = cgroup.availability()
    if not ok:
        log(f"cgroups not writable: {where}; running every system once WITHOUT a memory limit")
        limits = [None]
    env = child_env()

    runs = []
    for limit in limits:
        for system in systems:
            path = ggufs[system] if is_stock(system) else model_dir
            reserve = None
            if not is_stock(system) and limit is not None:
                reserve, _ = reserve_of.get(system) or choose_reserve(fixed_reserve, model_dir, None,
                                                                      n_ctx=args.ctx_size)
            entry, bj = bench_run(system, path, limit, reserve, args, env=env, account=ok,
                                  drop_cache=not args.no_drop_cache)
            if bj is not None and not is_stock(system) and limit is None and system not in reserve_of:
                reserve_of[system] = choose_reserve(fixed_reserve, model_dir, bj, entry["cgroup"].get("max_usage_bytes"))
            runs.append(entry)

    # quality: held-out perplexity of every system, once, without a limit (see the docstring)
    ppl = {}
    if args.perplexity_from:
        # perplexity depends on the weights and the computation, not on the machine's load: reuse
        # an earlier run's measurement of the same systems (recorded as such in the JSON)
        earlier = json.loads(Path(args.perplexity_from).read_text())
        ppl = {s: dict(v, measured_in=Path(args.perplexity_from).name)
               for s, v in (earlier.get("perplexity") or {}).items() if s in systems}
    elif args.perplexity:
        ppl = measure_perplexities({s: ggufs[s] if is_stock(s) else model_dir for s in systems}, args,
                                   env=env, account=ok)

    add_greedy_match(runs)
    stock_desc = next((e["result"]["stock"] for e in runs if e.get("result")), None)
    return {
        "benchmark": "side_by_side",
        **model_doc(gguf, model_dir),
        "stock": stock_desc,
        "systems": systems,
        "limits_bytes": limits,
        "cgroup": cgroup_doc(ok, where),
        "settings": {"ppl_ctx": args.ppl_ctx, "ppl_chunks": args.ppl_chunks, "sparsity": args.sparsity,
                     "n_prompt": args.n_prompt, "n_gen": args.n_gen, "repetitions": args.repetitions,
                     "n_ctx": args.ctx_size, "n_batch": args.batch_size, "n_threads": args.threads,
                     "timeout_s": args.timeout,
                     "plugin_reserve": {m: {"bytes": r, "how": how} for m, (r, how) in reserve_of.items()},
                     "page_cache_dropped": not args.no_drop_cache,
                     "prompt": "bundled held-out technical text (leanstream_tools/data)"},
        "machine": measure.machine_info(),
        "runs": runs,
        "perplexity": ppl or None,
    }


def portable(text: str) -> str:
    """Results are committed: no machine-specific paths (checkout, model cache, home, our cgroup)."""
    from leanstream_ggml.build import cache_dir

    ok, where = cgroup.availability()
    for path, name in ((str(REPO), "<repo>"), (str(cache_dir()), "<cache>"), (os.path.expanduser("~"), "~")) + \
            (((where, "<own memory cgroup>"),) if ok else ()):
        text = text.replace(json.dumps(path)[1:-1], name)
    return text


def plot(doc: dict, path: str) -> None:
    """Decode tok/s vs memory limit, one line per system; failed runs marked at 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limited = sorted({e["limit_bytes"] for e in doc["runs"] if e["limit_bytes"] is not None})
    top = (max(limited) if limited else 10**9) / 1e6
    x_none = top * 1.2 if limited else 1.0  # "no limit" sits to the right of the largest limit

    def xpos(lim):
        return x_none if lim is None else lim / 1e6

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for system in doc["systems"]:
        pts = sorted(((xpos(e["limit_bytes"]), (e.get("result") or {}).get("decode_tok_s"), e["status"])
                      for e in doc["runs"] if e["system"] == system), key=lambda t: t[0])
        good = [(x, y) for x, y, s in pts if s == "ok" and y is not None]
        label = ("stock llama-cpp-python (mmap)" if system == STOCK else
                 f"stock, {stock_quant(system)} (mmap)" if is_stock(system) else f"leanstream {system}")
        line, = ax.plot([p[0] for p in good], [p[1] for p in good], marker="o", label=label)
        bad = [(x, s) for x, y, s in pts if s not in ("ok",)]
        for x, s in bad:
            ax.plot([x], [0], marker="x", color=line.get_color(), markersize=9)
            ax.annotate(s, (x, 0), textcoords="offset points", xytext=(3, 8), ha="left", va="bottom", fontsize=7,
                        rotation=90, color=line.get_color())
    ticks = [lim / 1e6 for lim in limited] + [x_none]
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:.0f}" for t in ticks[:-1]] + ["none"], rotation=45 if len(ticks) > 6 else 0)
    ax.set_xlabel("whole-process memory limit (MB, cgroup)" if doc["cgroup"]["writable"]
                  else "memory limit (NOT applied: cgroups not writable)")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(bottom=0)
    m = doc["machine"]
    loads = [e["loadavg_1min_at_start"] for e in doc["runs"] if e.get("loadavg_1min_at_start") is not None]
    load = f", load avg {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    ax.set_title(f"{doc['model']}\n{m['cores']} cores {m['cpu']}, {doc['settings']['n_threads']} threads{load}, "
                 f"{m['date']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = benchkit.parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="GGUF path or model recipe name")
    ap.add_argument("--model-dir", default=None, help="converted model directory (default: converted on first use)")
    ap.add_argument("--systems", default="stock,dense", help="comma list: stock and/or LeanStream modes")
    ap.add_argument("--limits", default="none,300MB,200MB,150MB",
                    help="comma list of whole-process memory limits (none = no limit)")
    ap.add_argument("-p", "--n-prompt", type=int, default=64)
    ap.add_argument("-n", "--n-gen", type=int, default=16)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("-b", "--batch-size", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--perplexity", action="store_true",
                    help="also measure each system's held-out perplexity (once, without a limit)")
    ap.add_argument("--perplexity-from", default=None, metavar="JSON",
                    help="take the perplexities from an earlier run's JSON instead of measuring them again")
    ap.add_argument("--ppl-ctx", type=int, default=512, help="perplexity window (n_ctx; second half scored)")
    ap.add_argument("--ppl-chunks", type=int, default=None, help="perplexity windows (default: every one of the text)")
    benchkit.flags(ap, "sparsity")
    ap.add_argument("--reserve", default=None,
                    help="memory a LeanStream run keeps outside its weight budget (default: measured, see above)")
    ap.add_argument("--timeout", type=float, default=900, help="wall-clock cap per run (s); past it: 'timeout'")
    ap.add_argument("--no-drop-cache", action="store_true", help="keep the model files' page cache (warm runs)")
    ap.add_argument("--no-private-copy", dest="private_copy", action="store_false",
                    help="benchmark the model files in place instead of private copies")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    ap.add_argument("--plot", default=None, help="write the PNG plot here")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="only redraw the plot of an earlier run's JSON (to --plot, default: beside it)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.replot:  # redraw the figure of an earlier run, measure nothing
        doc = json.loads(Path(args.replot).read_text())
        plot(doc, args.plot or str(Path(args.replot).with_suffix(".png")))
        return 0
    doc = run(args)
    text = portable(json.dumps(doc, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot(doc, args.plot)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
