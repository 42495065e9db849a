"""Read planning and neuron order under a memory budget: decode speed and what the disk does.

    python bench/read_planning.py --dirs none=/path/gguf-order.lsm,coact=/path/coact.lsm \
        --budgets 0.35,0.5 --configs dense,leanstream:0,leanstream:auto,leanstream:auto:0.9 --rounds 2 \
        --out bench/results/read_planning-qwen2.5-1.5b.json --plot bench/results/read_planning-qwen2.5-1.5b.png

Every (order, mode, bridge) configuration runs at every budget, interleaved per round (all
configurations of a round back to back, so they share the machine's state). Each run is a fresh
Llama: a prompt, --warmup decoded tokens (the cache fills), then --tokens decoded tokens of the
bundled held-out text, teacher-forced (every token differs, as in generation), timed. Block
reads use O_DIRECT, so the page cache does not hide them. Budgets are fractions of the FFN
bytes on disk and cover the sketch (leanstream mode) as well as the cache; a configuration whose
budget is too small is reported as such.

Per run, over the timed tokens: decode tok/s, reads per token, mean read size, MB read, MB
bridged (read through gaps and dropped) and MB computed per token, I/O worker CPU per read and
per token, and the disk model the engine measured (per-I/O time, bandwidth, bridge bytes).
Prints one JSON document.
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

from leanstream_ggml.native import modes  # noqa: E402

PROMPT = "The main differences between a process and a thread are"


def ffn_bytes(model_dir: Path) -> int:
    from leanstream_ggml.model import manifest as mf

    m = mf.load(model_dir)
    return sum((model_dir / e.file).stat().st_size for e in m.layers)


def run_one(model_dir: Path, mode: str, bridge, hot, budget: int, args) -> dict:
    from leanstream_ggml import Llama
    from leanstream_ggml.native.engine import LeanstreamError
    from leanstream_tools.bench import DEFAULT_TEXT

    try:
        llm = Llama(str(model_dir), mode=mode, memory_budget=budget, bridge_bytes=bridge, hot_fraction=hot, n_ctx=512,
                    n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    except (LeanstreamError, ValueError) as e:
        return {"error": str(e).splitlines()[0]}
    try:
        toks = llm.tokenize(PROMPT.encode())
        text = llm.tokenize(DEFAULT_TEXT.read_text(encoding="utf-8").encode(), add_bos=False)
        llm.eval(toks)
        for t in text[:args.warmup]:
            llm.eval([t])
        llm.reset_stats()
        cont = text[args.warmup:args.warmup + args.tokens]
        t0 = time.perf_counter()
        for t in cont:
            llm.eval([t])
        dt = time.perf_counter() - t0
        s = llm.stats()
        n = len(cont)
        reads = s["reads_issued"]
        return {"decode_tps": n / dt, "reads_per_token": reads / n,
                "mean_read_kib": s["bytes_read"] / max(1, reads) / 1024,
                "mb_read_per_token": s["bytes_read"] / n / 1e6, "mb_bridged_per_token": s["bytes_bridged"] / n / 1e6,
                "mb_computed_per_token": s["bytes_computed"] / n / 1e6,
                "io_cpu_us_per_read": s["io_cpu_ns"] / 1e3 / max(1, reads),
                "io_cpu_ms_per_token": s["io_cpu_ns"] / 1e6 / n,
                "io_stall_share": s["io_stall_ns"] / max(1, s["op_ns"] * args.threads),
                "disk_model": {"per_io_us": s["io_per_io_ns"] / 1e3, "bandwidth_mb_s": s["io_bandwidth"] / 1e6,
                               "bridge_kib": s["bridge_bytes"] / 1024},
                "cache_capacity_mb": s["cache_capacity"] / 1e6, "resident_mb": s["resident_bytes"] / 1e6,
                "hot_blocks": s["hot_blocks"], "miss_ratio": s["miss_ratio"]}
    finally:
        llm.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dirs", required=True, help="ORDER=DIR,... converted model directories, one per neuron order")
    ap.add_argument("--budgets", default="0.35,0.5")
    ap.add_argument("--configs", default="dense,leanstream:0,leanstream:auto,leanstream:auto:0.9",
                    help="MODE[:BRIDGE[:HOT[:ORDERS]]],... BRIDGE: auto (the disk model) or bytes; HOT: "
                         "hot_fraction (default: the mode's); ORDERS: names of --dirs joined by '+' (default: "
                         "all; dense runs on the first dir only: the order changes nothing there)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)

    dirs = dict(x.split("=", 1) for x in args.dirs.split(","))
    dirs = {k: Path(v) for k, v in dirs.items()}
    first = next(iter(dirs))
    ffn = ffn_bytes(dirs[first])
    configs = []
    for c in args.configs.split(","):
        mode, bridge, hot, orders = (c.split(":") + [None] * 4)[:4]
        names = orders.split("+") if orders else (list(dirs) if modes.is_sparse(mode) else [first])
        for name in names:
            configs.append((name, dirs[name], mode, None if bridge in (None, "auto") else int(bridge),
                            None if hot is None else float(hot)))
    results = []
    for frac in [float(x) for x in args.budgets.split(",")]:
        budget = int(frac * ffn)
        for rnd in range(args.rounds):
            for name, d, mode, bridge, hot in configs:
                r = run_one(d, mode, bridge, hot, budget, args)
                r.update(order=name, mode=mode, bridge="auto" if bridge is None else bridge, hot_fraction=hot,
                         budget_fraction=frac, budget_mb=budget / 1e6, round=rnd)
                print(json.dumps(r), file=sys.stderr, flush=True)
                results.append(r)
    summary = []
    for frac in sorted({r["budget_fraction"] for r in results}):
        for name, d, mode, bridge, hot in configs:
            b = "auto" if bridge is None else bridge
            rs = [r for r in results if r["budget_fraction"] == frac and r["order"] == name and r["mode"] == mode
                  and r["bridge"] == b and r["hot_fraction"] == hot and "error" not in r]
            if not rs:
                continue
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]
                   if isinstance(rs[0][k], float) and k not in ("budget_fraction", "hot_fraction")}
            summary.append({"budget_fraction": frac, "order": name, "mode": mode, "bridge": b, "hot_fraction": hot, **med,
                            "decode_tps_all": [r["decode_tps"] for r in rs]})
    doc = {"dirs": {k: str(v) for k, v in dirs.items()}, "ffn_bytes": ffn, "threads": args.threads,
           "tokens": args.tokens, "warmup": args.warmup, "rounds": args.rounds, "summary": summary, "runs": results}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot(summary, args.plot)
    return 0


def plot(summary, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    keys = sorted({(r["order"], r["mode"], str(r["bridge"]), str(r["hot_fraction"])) for r in summary})
    for k in keys:
        pts = sorted((r["budget_fraction"], r["decode_tps"]) for r in summary
                     if (r["order"], r["mode"], str(r["bridge"]), str(r["hot_fraction"])) == k)
        label = f"{k[1]} order={k[0]} bridge={k[2]} hot={k[3]}" if modes.is_sparse(k[1]) else k[1]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("memory budget (fraction of FFN bytes on disk)")
    ax.set_ylabel("decode tok/s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
