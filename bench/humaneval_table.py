"""HumanEval pass@1 of one model across setups: stock quantizations, plugin dense, leanstream.

    python bench/humaneval_table.py --model qwen2.5-coder-1.5b-instruct --model-dir model.lsm \
        --limit 20 --out-dir bench/results/humaneval-qwen2.5-coder-1.5b

Each setup is one `leanstream eval humaneval` run in its own process, one after the other (its
results JSON in --out-dir, resumable: a rerun continues what is there; a larger --limit extends
it). Setups: "stock" (the GGUF given), "stock-<type>" (the same requantized with llama.cpp's
quantizer, leanstream_tools/quants.py), "dense" (plugin dense mode), "leanstream" (its
default sparsity) and "leanstream@<quality>" (e.g. leanstream@ppl+5%). The sparse setups get
--memory-budget (default: one block short of the FFN + sketch, read from the manifest: every op
then selects through the sketch, as under any smaller budget; a budget that holds everything
selects from exact scores of every block instead and does better than a limited user sees).

Prints one JSON document: per setup pass@1, problems solved, decode tok/s, and the problems that
flip against --baseline (default "dense") each way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import benchkit
from leanstream_ggml.cli import command_line
from leanstream_tools import humaneval
from leanstream_tools.compare import selecting_budget

DEFAULT_SETUPS = "stock,stock-q3_k_m,stock-q2_k,dense,leanstream,leanstream@ppl+5%"


def setup_args(setup: str, gguf: Path, model_dir: Path, budget: int, threads: int) -> list[str]:
    """`leanstream eval humaneval` arguments of one setup."""
    from leanstream_ggml.native import modes
    from leanstream_tools import compare, quants

    common = ["-t", str(threads)]
    if compare.is_stock(setup):
        if compare.stock_quant(setup) is None:
            return [str(gguf), *common]
        return [str(quants.requantize(gguf, compare.stock_quant(setup), n_threads=threads,
                                      log=lambda m: print(m, file=sys.stderr))), *common]
    mode, quality = compare.plugin_mode(setup)
    if quality is not None and mode == modes.QUALITY:
        return [str(model_dir), compare.flag("quality"), quality, compare.flag("memory_budget"), str(budget), *common]
    if quality is None and mode in modes.MODES:
        budget_args = [compare.flag("memory_budget"), str(budget)] if modes.is_sparse(mode) else []
        return [str(model_dir), compare.flag("mode"), mode, *budget_args, *common]
    raise ValueError(f"unknown setup {setup!r} (stock, stock-<type>, dense, leanstream, leanstream@<quality>)")


def main(argv=None) -> int:
    import os

    from leanstream_ggml.model import registry

    ap = benchkit.parser(__doc__)
    ap.add_argument("--model", required=True, help="GGUF path or recipe name (the stock source)")
    ap.add_argument("--model-dir", required=True, help="its converted model directory")
    ap.add_argument("--setups", default=DEFAULT_SETUPS)
    ap.add_argument("--baseline", default="dense", help="the setup flips are counted against")
    ap.add_argument("--limit", type=int, default=None, help="the first N problems (default: all 164)")
    ap.add_argument("--max-tokens", type=int, default=humaneval.DEFAULT_MAX_TOKENS)
    benchkit.flags(ap, "memory_budget")   # the sparse setups' (default: one block short of FFN + sketch)
    ap.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--out", default=None, help="the summary JSON (default: OUT_DIR/summary.json)")
    args = ap.parse_args(argv)

    gguf, model_dir, out_dir = registry.resolve(args.model), Path(args.model_dir), Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = args.memory_budget or selecting_budget(model_dir)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    docs, rows = {}, []
    for s in setups:
        path = out_dir / f"{s.replace('@', '-at-').replace('%', 'pct').replace('+', '')}.json"
        cmd = [*command_line(), "eval", "humaneval",
               *setup_args(s, gguf, model_dir, budget, args.threads), "--max-tokens", str(args.max_tokens),
               "--out", str(path), "--quiet", *(["--limit", str(args.limit)] if args.limit else [])]
        print(f"[{s}] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
        r = subprocess.run(cmd, text=True, capture_output=True)
        if r.returncode != 0:
            rows.append({"setup": s, "error": r.stderr.strip().splitlines()[-1:]})
            continue
        docs[s] = json.loads(path.read_text(encoding="utf-8"))
        rows.append({"setup": s, "file": path.name, "settings": docs[s]["settings"],
                     **humaneval.summary(docs[s])})
        print(f"[{s}] {r.stdout.strip()}", file=sys.stderr, flush=True)
    if args.baseline in docs:
        for row in rows:
            if row["setup"] in docs:
                f = humaneval.flips(docs[row["setup"]], docs[args.baseline])
                row["vs_baseline"] = {"gained": f["only_a"], "lost": f["only_b"], "both": f["both"],
                                      "neither": f["neither"]}
    summary = {"bench": "humaneval_table", "model": str(gguf), "model_dir": str(model_dir), "limit": args.limit,
               "max_tokens": args.max_tokens, "sparse_memory_budget": budget, "threads": args.threads,
               "baseline": args.baseline, "rows": rows}
    Path(args.out or out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
