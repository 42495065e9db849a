"""`leanstream compare`: one model's setups side by side under one whole-process memory limit.

    leanstream compare qwen2.5-coder-1.5b-instruct --memory-limit 1GB --out cmp.json --plot cmp.png
    leanstream compare model.gguf --memory-limit 600MB --short     # a smoke test (CI: SmolLM2)

Setups (--setups, a comma list; default: stock, stock+lookup, stock-q3_k_m, stock-q3_k_m+lookup,
stock-q2_k, dense, dense+off, leanstream, leanstream@ppl+5%):

- "stock": stock llama-cpp-python (llama_cpp.Llama, mmap, its defaults) on the GGUF given, the
  source quant. It always runs: beyond the limit its mmap'd pages are read from disk again.
- "stock-q3_k_m", "stock-q2_k" (any "stock-<type>" of leanstream_tools/quants.py): the same on a smaller
  quantization made from that GGUF with llama.cpp's quantizer (cached next to it), a stock
  user's alternative. One whose file is not smaller than the source's is not run; one whose
  file alone is larger than the limit does not fit and is not run.
- "dense", "leanstream" (any engine mode): the plugin on the converted model directory
  (--model-dir; else the converter's default place, converted on first use and kept);
  "MODE@ppl+N%", e.g. "leanstream@ppl+5%": leanstream at the sparsity quality="ppl+N%" takes
  from the converter's calibration. A mode the directory cannot run (no sketch, no
  calibration) is not run, and the reason is given.
- speculative decoding, a suffix: "stock+lookup", "stock-q3_k_m+lookup": the same stock setup
  with llama-cpp-python's prompt lookup decoding (draft_model=LlamaPromptLookupDecoding, its
  default 10 tokens a proposal; logits_all, which its draft path needs); "dense+off" (plain
  decoding), "dense+auto", "dense+self", "dense+ngram": the plugin's speculative kind, a bare
  "dense" the library's default (auto). The sparse modes decode plainly ("+self" and "+ngram"
  are refused there). Every run records its kind, a plugin run with speculation its stats
  (tokens per pass, acceptance, draft step ms); the twins share one perplexity measurement
  (speculation changes no logit).

Measured for each setup:

- decode tok/s and peak memory: `leanstream bench --json` in a fresh process inside its own
  child memory cgroup limited to --memory-limit (leanstream_tools/cgroup.py: the whole process, page
  cache of its mmap'd files included). Peak = the cgroup's charged peak, what the limit binds
  (peak RSS, VmHWM, where cgroups are not writable). Before each run the page cache of its
  model files is dropped; the files are private copies no other process reads. A plugin
  setup runs with `--memory-limit` = the limit: the child's memory plan (memplan.py: the
  interpreter, the non-FFN weights each token reads, KV cache, llama.cpp's heap and compute
  buffers) gives its FFN engine the rest, and a limit the plan cannot hold does not fit (the
  plan's numbers are the reason).
- held-out perplexity ratio: `leanstream perplexity` over windows of --ppl-ctx tokens of the
  bundled held-out text (second halves scored; the sparse modes token by token, as they
  decode, because prefill is dense), measured without a limit (a limit changes where the
  weights are read from, not what is computed; the sparse modes get a budget one block short
  of their FFN + sketch, so that they select through the sketch as under every limit: a budget
  holding everything selects from exact scores and does better), divided by stock's.

Where cgroups are not writable every setup runs once without any limit (no cgroup, no plugin
budget) and the table, the JSON and the plot say so. Prints a table; --out writes every
measurement as JSON, --plot a PNG: ppl ratio against decode tok/s, one point per setup, the
Pareto front (the setups no other one beats on both) marked.

Three layers: setups.py (the names, what is decided before running), runner.py (the files,
the child runs and their typed results: a ChildRun per child process, a RunRecord per bench
run, a memory plan's refusal a PlanRefused), report.py (a ReportRow per setup, the Pareto
front, the table, the plot: all read one Report, whose to_dict() is the JSON).
bench/side_by_side.py (several limits, decode tok/s against the limit) shares the runner with
the command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .. import cgroup, measure
from .report import (  # noqa: F401
    Report, ReportRow, cgroup_doc, failure_reason, format_table, front_of, limit_label, limit_line, make_rows,
    model_doc, pareto_front, plot, plot_rows)
from .runner import (  # noqa: F401
    RESERVE_MARGIN, ROOT, ChildRun, PlanRefused, RunRecord, add_greedy_match, bench_command, bench_record, bench_run,
    child_env, choose_reserve, engine_args, flag, greedy_match, log, measure_perplexities, perplexity_command,
    plugin_budget, prepare_models, private_copies, read_json, resolve_model_dir, run_child, stock_files, summarize,
    workspace)
from .setups import (  # noqa: F401
    DEFAULT_SETUPS, STOCK, check_setups, is_stock, parse_limit, parse_systems, plan_setups, plugin_availability,
    plugin_mode, selecting_budget, sketch_bytes, speculative_kind, split_speculative, stock_fit, stock_quant)

# (n_prompt, n_gen, repetitions, perplexity windows): a measurement, and --short's smoke test
FULL = {"n_prompt": 64, "n_gen": 32, "repetitions": 3, "ppl_chunks": None}
SHORT = {"n_prompt": 16, "n_gen": 8, "repetitions": 1, "ppl_chunks": 1}


def run(args) -> Report:
    """Measure every setup of ``args`` and return the report (see the module docstring)."""
    systems = check_setups(parse_systems(args.setups))
    limit = parse_limit(args.memory_limit)
    source, ggufs_orig, dir_orig = prepare_models(args.model, systems, args.model_dir)
    ok, where = cgroup.availability()
    applied = ok and limit is not None
    if limit is not None and not ok:
        log(f"cgroups not writable: {where}; every setup runs WITHOUT the memory limit "
            f"{measure.format_size(limit)} (no cgroup, no plugin budget)")
    run_limit = limit if applied else None
    plans = plan_setups(systems, ggufs_orig, dir_orig, limit, applied, args.sparsity)
    todo = [s for s in systems if plans[s]["status"] == "planned"]
    for s in systems:
        if s not in todo:
            log(f"{s:>18}: {plans[s]['status']} ({plans[s]['reason']})")
    env = child_env()
    runs = {}
    with workspace({s: ggufs_orig[s] for s in todo if is_stock(s)} | {STOCK: ggufs_orig[STOCK]},
                   dir_orig if any(not is_stock(s) for s in todo) else None, args.private_copy) as (ggufs, model_dir):
        def path_of(s):
            return ggufs[s] if is_stock(s) else model_dir

        # every setup under the limit, back to back (the plugin setups by their memory plan)
        for s in todo:
            runs[s], _ = bench_record(s, path_of(s), run_limit, None, args, env=env, account=ok)
        # quality: stock on the source (the reference of every ratio, a setup or not) and every setup that ran
        scored = [STOCK] + [s for s in todo if s != STOCK and runs[s].status == "ok"]
        ppl = measure_perplexities({s: path_of(s) for s in scored}, args, env=env, account=ok)
    add_greedy_match(list(runs.values()))
    rows = make_rows(systems, plans, runs, ppl, accounted=ok)
    return Report(
        **model_doc(source, dir_orig),
        memory_limit_bytes=limit,
        limit_applied=applied,
        cgroup=cgroup_doc(ok, where),
        setups=rows,
        pareto_front=front_of(rows),
        settings={"n_prompt": args.n_prompt, "n_gen": args.n_gen, "repetitions": args.repetitions,
                  "n_ctx": args.ctx_size, "n_batch": args.batch_size, "n_threads": args.threads,
                  "ppl_ctx": args.ppl_ctx, "ppl_chunks": args.ppl_chunks, "sparsity": args.sparsity,
                  "short": args.short, "timeout_s": args.timeout, "private_copy": args.private_copy,
                  "page_cache_dropped": True,
                  "plugin_budget": "each plugin setup's memory plan under the limit (memplan.py)",
                  "prompt": "bundled held-out technical text (leanstream_tools/data)"},
        stock=next((e.result["stock"] for e in runs.values() if e.result), None),
        stock_files=stock_files({s: ggufs_orig[s] for s in systems if is_stock(s)}, source),
        machine=measure.machine_info(),
        runs=list(runs.values()),
        perplexity=ppl)


def _sized(args) -> None:
    """-p/-n/-r/--ppl-chunks given, else --short's or a measurement's sizes."""
    sizes = SHORT if args.short else FULL
    for k, v in sizes.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.threads = args.threads or len(os.sched_getaffinity(0))


def cmd_compare(args) -> int:
    _sized(args)
    report = run(args)   # bad values and paths: one line (leanstream_ggml/errors.py, in cli.main)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    if args.plot:
        plot(report, args.plot)
    print(format_table(report))
    if not report.limit_applied and report.memory_limit_bytes is not None:
        print(f"\nNOTE: {limit_line(report)}", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("compare", help="stock quants and the plugin side by side under one memory limit",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from leanstream_ggml.options import add_flags

    p.add_argument("model", help="GGUF file (the source quant stock runs) or model recipe name")
    add_flags(p, "compare")   # --memory-limit (every run's cgroup), --sparsity
    p.add_argument("--model-dir", default=None,
                   help="the converted model directory (default: the converter's place, converted on first use)")
    p.add_argument("--setups", default=",".join(DEFAULT_SETUPS), help="comma list (default: %(default)s)")
    p.add_argument("--out", default=None, help="write every measurement here as JSON")
    p.add_argument("--plot", default=None, help="write the plot here (PNG; needs matplotlib)")
    p.add_argument("--short", action="store_true",
                   help=f"a smoke test: -p {SHORT['n_prompt']} -n {SHORT['n_gen']} -r {SHORT['repetitions']} and "
                        f"{SHORT['ppl_chunks']} perplexity window (default: -p {FULL['n_prompt']} -n {FULL['n_gen']} "
                        f"-r {FULL['repetitions']}, every window of the text)")
    p.add_argument("-p", "--n-prompt", type=int, default=None, help="prompt tokens of the bench runs")
    p.add_argument("-n", "--n-gen", type=int, default=None, help="decoded tokens of the bench runs")
    p.add_argument("-r", "--repetitions", type=int, default=None, help="bench repetitions (median reported)")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="n_ctx of the bench runs")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="n_batch (= n_ubatch)")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: cores available)")
    p.add_argument("--ppl-ctx", type=int, default=512, help="perplexity window (n_ctx; second half scored)")
    p.add_argument("--ppl-chunks", type=int, default=None, help="perplexity windows (default: every one of the text)")
    p.add_argument("--timeout", type=float, default=900, help="wall-clock cap per run (s); past it: 'timeout'")
    p.add_argument("--no-private-copy", dest="private_copy", action="store_false",
                   help="run on the model files in place instead of private copies")
    p.set_defaults(func=cmd_compare)
