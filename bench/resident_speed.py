"""Decode and prefill speed with the whole FFN in RAM (100 % budget): stock llama-cpp-python on the
source GGUF against the plugin's dense mode and its sparse modes, interleaved round by round in
one run so that a busy neighbour slows every system alike. This is where the FFN kernels show:
each system is timed on the second of two prefill + decode repetitions in one process, when the
plugin's blocks are resident (the first prefill reads them from disk) and stock's GGUF is in the
page cache. Decode is the greedy continuation of a prompt of held-out text.

    python bench/resident_speed.py MODEL_DIR SOURCE.gguf [--modes dense,leanstream,...]
        [--sparsity 0.5] [--rounds 3] [--prompt 512] [--gen 32] [--threads 2] [--out results.jsonl]

Prints one JSON line per (round, system) and a summary line per system at the end:
decode and prefill tok/s (median over rounds) and their ratio to stock in the same rounds.
Sparse modes other than leanstream need predictors in the model directory (converted with
--predictors); they are skipped, with a note, when it has none.

    python bench/resident_speed.py MODEL_DIR --op-rows 1,2,5,9,17,33,64 [--rounds 5] [--threads 2]

The FFN op alone per row count (a speculative verify pass of T rows, or a short prefill): every
layer's op (ls_ffn_eval_layers, dense, memory budget unlimited, one thread start for all layers) on
T random rows, once the blocks are resident. Before it times, it checks that each row of a T-row
op equals the op on that row alone, bit for bit (the contract of batches up to LS_EXACT_ROWS;
larger T, a prefill, is timed only).
Row counts are interleaved round by round; prints one JSON object: per T the median ms per pass
and its range over rounds, and ms per extra row ((t(T) - t(1)) / (T - 1)).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import benchkit  # noqa: E402


def op_rows(model_dir: str, rows: list[int], rounds: int, threads: int, calls: int = 3) -> dict:
    """ms per op pass over every layer for each T in rows (see the module's docstring)."""
    import numpy as np

    from leanstream_ggml.native import engine
    from leanstream_ggml.model import manifest as mf

    man = mf.load(model_dir)
    paths = [man.resolve(model_dir, L.file) for L in man.layers]
    with engine.FFNEngine(paths, mode="dense", memory_budget=0) as e:
        n, n_embd = len(paths), e.layer_info(0)["n_embd"]
        x = np.random.default_rng(0).standard_normal((max(rows), n_embd)).astype(np.float32)
        e.eval_layers(0, n, x[:1], threads)   # reads every block; the layers stay resident
        for T in [T for T in rows if T <= engine.EXACT_ROWS]:   # correct before timed: each row as alone, bit for bit
            y = e.eval_layer(n - 1, x[:T], threads)
            for t in range(T):
                if not np.array_equal(y[t], e.eval_layer(n - 1, x[t:t + 1], threads)[0]):
                    raise SystemExit(f"row {t} of a {T}-row op differs from that row alone")
        ms: dict[int, list[float]] = {T: [] for T in rows}
        for _ in range(rounds):
            for T in rows:
                best = float("inf")
                for _ in range(calls):   # the best of a few calls: a busy neighbour only adds time
                    t0 = time.perf_counter()
                    e.eval_layers(0, n, x[:T], threads)
                    best = min(best, time.perf_counter() - t0)
                ms[T].append(best * 1e3)
    med = {T: statistics.median(v) for T, v in ms.items()}
    base = med.get(1)
    return {"model": man.source.filename,
            "layers": n, "threads": threads, "rounds": rounds, "kernel_isa": engine.kernel_isa(),
            "load1": os.getloadavg()[0],
            "ms_per_pass": {str(T): round(med[T], 2) for T in rows},
            "ms_range": {str(T): [round(min(v), 2), round(max(v), 2)] for T, v in ms.items()},
            "ms_per_extra_row": {str(T): round((med[T] - base) / (T - 1), 2) for T in rows if base and T > 1}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("gguf", nargs="?", help="the source GGUF (stock llama-cpp-python runs it)")
    ap.add_argument("--op-rows", help="time the FFN op alone for these row counts (comma-separated)")
    ap.add_argument("--modes", default="dense,leanstream", help="plugin modes, comma-separated")
    benchkit.flags(ap, "sparsity")   # (default: the engine's)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512, help="prefill length (tokens)")
    ap.add_argument("--gen", type=int, default=32, help="decoded tokens per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="also append the JSON lines to this file")
    args = ap.parse_args(argv)
    if args.op_rows:
        rows = sorted({int(r) for r in args.op_rows.split(",")})
        print(json.dumps(op_rows(args.model_dir, rows, args.rounds, args.threads)), flush=True)
        return 0
    if not args.gguf:
        ap.error("the source GGUF is needed (or --op-rows)")

    from leanstream_ggml.native import engine, modes
    from leanstream_ggml.model import manifest as mf
    from leanstream_tools import bench

    man = mf.load(args.model_dir)
    systems = [("stock", args.gguf, {"system": "stock"})]
    for m in [m.strip() for m in args.modes.split(",") if m.strip()]:
        extra = {"sparsity": args.sparsity} if modes.is_sparse(m) and args.sparsity is not None else None
        if modes.is_sparse(m):
            try:
                man.mode_files(args.model_dir, modes.uses(m), m)
            except ValueError as e:
                print(json.dumps({"skipped": m, "why": str(e)}), flush=True)
                continue
        name = f"{m} s={args.sparsity:g}" if extra else m
        systems.append((name, args.model_dir, {"mode": m, "extra": extra}))

    out = open(args.out, "a") if args.out else None
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in systems}
    for rnd in range(args.rounds):
        for name, path, kw in systems:
            r = bench.bench(path, n_prompt=args.prompt, n_gen=args.gen, repetitions=2, n_threads=args.threads,
                            n_ctx=args.prompt + args.gen + 16, **kw)
            warm = r["repetitions"][-1]   # the first repetition loads the blocks / fills the page cache
            row = {"round": rnd, "system": name, "decode_tok_s": warm["decode_tok_s"],
                   "prefill_tok_s": warm["prefill_tok_s"], "load1": os.getloadavg()[0],
                   "kernel_isa": engine.kernel_isa()}
            rows[name].append(row)
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
    for name in rows:
        ratio = {}
        for key in ("decode_tok_s", "prefill_tok_s"):
            ratio[key] = statistics.median(a[key] / s[key] for a, s in zip(rows[name], rows["stock"]))
        summary = {"summary": name, "model": Path(args.gguf).name, "threads": args.threads,
                   "prompt": args.prompt, "gen": args.gen, "rounds": args.rounds,
                   "decode_tok_s": statistics.median(a["decode_tok_s"] for a in rows[name]),
                   "prefill_tok_s": statistics.median(a["prefill_tok_s"] for a in rows[name]),
                   "decode_vs_stock": ratio["decode_tok_s"], "prefill_vs_stock": ratio["prefill_tok_s"]}
        print(json.dumps(summary), flush=True)
        if out:
            out.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
