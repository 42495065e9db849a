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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import benchkit  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("gguf", help="the source GGUF (stock llama-cpp-python runs it)")
    ap.add_argument("--modes", default="dense,leanstream", help="plugin modes, comma-separated")
    benchkit.flags(ap, "sparsity")   # (default: the engine's)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512, help="prefill length (tokens)")
    ap.add_argument("--gen", type=int, default=32, help="decoded tokens per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="also append the JSON lines to this file")
    args = ap.parse_args(argv)

    from leanstream_ggml import engine, manifest as mf, modes
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
