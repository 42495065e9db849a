"""`leanstream bench` and `leanstream perplexity` (llama-bench / llama-perplexity for both systems).

    leanstream bench model.lsm -p 128 -n 32 -r 3 --memory-budget 512MiB --json
    leanstream bench model.gguf                       # the same, stock llama-cpp-python
    leanstream perplexity model.lsm --reference model.gguf --json
    leanstream perplexity model.gguf                  # stock perplexity, computed identically

MODEL is a model directory (leanstream), a GGUF file (stock) or a model recipe name
(`smollm2-135m-instruct`, `qwen2.5-coder-1.5b-instruct`, `qwen2.5-coder-0.5b-instruct`, `gemma3-270m`: the cached GGUF, stock).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


# `leanstream bench --plan-refused-file F`: the exit status when the memory plan refuses the limit
# (the plan is then in F as JSON; compare's runner reads it there)
PLAN_REFUSED_EXIT = 3


def resolve(model: str) -> Path:
    import errno

    from leanstream_ggml.model import registry

    p = registry.resolve(model)
    if not p.exists():
        raise FileNotFoundError(errno.ENOENT, "no such model directory, GGUF file or model name", str(p))
    return p


def common_flags(p: argparse.ArgumentParser, command: str) -> None:
    """The model, the system, the engine's options ``command`` takes (leanstream_ggml/options.py),
    threads and batch, and the JSON output."""
    from leanstream_ggml.options import add_flags

    from .systems import SYSTEMS

    p.add_argument("model", help="model directory (leanstream), GGUF file (stock) or recipe name")
    p.add_argument("--system", choices=SYSTEMS, default=None,
                   help="default: leanstream for a directory, stock for a GGUF")
    add_flags(p, command)
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: cores available)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="n_batch (= n_ubatch)")
    p.add_argument("--json", action="store_true", help="print one JSON document on one line")
    p.add_argument("--json-file", default=None, metavar="FILE", help="also write the JSON document to FILE")
    p.add_argument("--plan-refused-file", default=None, metavar="FILE",
                   help="leanstream: where the memory plan refuses --memory-limit, write the plan to FILE as JSON "
                        f"and exit with status {PLAN_REFUSED_EXIT}")


def register(subparsers) -> None:
    b = subparsers.add_parser("bench", help="prefill/decode tokens/s, peak RSS, disk bytes (llama-bench style)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_flags(b, "bench")
    b.add_argument("-p", "--n-prompt", type=int, default=128, help="prompt tokens (prefill test)")
    b.add_argument("-n", "--n-gen", type=int, default=32, help="generated tokens (decode test)")
    b.add_argument("-r", "--repetitions", type=int, default=3, help="repetitions; medians are reported")
    b.add_argument("-c", "--ctx-size", type=int, default=None, help="n_ctx (default: max(512, p + n))")
    b.add_argument("--text", default=None, help="prompt text file (default: the bundled held-out text)")
    b.set_defaults(func=cmd_bench)

    q = subparsers.add_parser("perplexity", help="perplexity on a text; agreement and KL vs a reference",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_flags(q, "perplexity")
    q.add_argument("--text", default=None, help="text file, or .jsonl chats (one conversation per line, scored "
                                                "in the model's chat template; default: the bundled held-out "
                                                "technical text)")
    q.add_argument("-c", "--ctx-size", type=int, default=512, help="window size n_ctx (second half is scored)")
    q.add_argument("--chunks", type=int, default=None, help="at most this many windows")
    q.add_argument("--decode", action=argparse.BooleanOptionalAction, default=None,
                   help="score the second half of each window token by token, as generation runs "
                        "(default: on for the sparse modes, which are sparse only there)")
    q.add_argument("--reference", default=None,
                   help="GGUF (or recipe name) run with stock llama-cpp-python over the same windows: "
                        "adds top-1 agreement and mean KL")
    q.set_defaults(func=cmd_perplexity)


# given to Llama as keywords of their own (systems.open_model's mode= and memory_budget=)
_OPEN_MODEL_ARGS = ("mode", "memory_budget")


def engine_extra(args, system: str) -> dict:
    """The engine options the user gave besides --mode and --memory-budget, as Llama keywords
    (the plugin only; memory_limit and memory_budget in bytes after check_params)."""
    from leanstream_ggml import options

    from .systems import PLUGIN

    if system != PLUGIN:
        if getattr(args, "memory_limit", None) is not None:
            from leanstream_ggml.native import params

            raise params.ParameterError("memory_limit", "plans the plugin's memory; stock llama.cpp takes no "
                                                        "limit (run it in a memory cgroup: `leanstream compare`)")
        return {}
    out = {k: v for k, v in options.given(args, args.command).items() if k not in _OPEN_MODEL_ARGS}
    if out.get("verify_checksums") is True:
        del out["verify_checksums"]     # the default: a report names it only when it is off
    return out


def check_params(args) -> None:
    """The engine options through the one validator (params.llama_options): a bad value is one
    line naming it, before any model is opened. Then --mode is the mode that runs (quality=
    implies leanstream mode's) and --memory-budget / --memory-limit are bytes (None: none)."""
    from leanstream_ggml import options
    from leanstream_ggml.native import params

    v = params.llama_options(options.given(args, args.command))
    args.mode = v["mode"]
    args.memory_budget = v["memory_budget"] or None     # bytes (None: no limit), one parser for all reports
    args.memory_limit = v["memory_limit"] or None


def one_line_model_errors(fn):
    """llama-cpp-python reports a model it cannot load as ValueError: one line, like every
    other user error (leanstream_ggml/errors.py). Where the caller named a --plan-refused-file,
    a memory plan's refusal is that file and its own exit status."""
    import functools

    @functools.wraps(fn)
    def run(args):
        from leanstream_ggml.memplan import MemoryPlanError

        try:
            return fn(args)
        except MemoryPlanError as e:
            print(f"leanstream {args.command}: {e}", file=sys.stderr)
            if getattr(args, "plan_refused_file", None) and e.plan is not None:
                Path(args.plan_refused_file).write_text(json.dumps({"message": str(e), "plan": e.plan.to_dict()}) + "\n")
                return PLAN_REFUSED_EXIT
            return 1
        except ValueError as e:
            print(f"leanstream {args.command}: {e}", file=sys.stderr)
            return 1
    return run


def emit(args, doc: dict) -> None:
    """--json-file: the document written there (before anything is printed)."""
    if getattr(args, "json_file", None):
        Path(args.json_file).write_text(json.dumps(doc) + "\n", encoding="utf-8")


@one_line_model_errors
def cmd_bench(args) -> int:
    from . import bench, systems

    check_params(args)
    model = resolve(args.model)
    r = bench.bench(model, args.system, n_prompt=args.n_prompt, n_gen=args.n_gen, repetitions=args.repetitions,
                    n_threads=args.threads, n_ctx=args.ctx_size, n_batch=args.batch_size, mode=args.mode,
                    memory_budget=args.memory_budget, text_path=args.text,
                    extra=engine_extra(args, args.system or systems.detect_system(model)))
    emit(args, r)
    if args.json:
        print(json.dumps(r), flush=True)
    else:
        print(bench.format_table([r]))
        eng = r.get("engine_decode")
        if eng:
            print("engine (decode, last repetition): " + ", ".join(f"{k}={v}" for k, v in eng.items()))
    return 0


@one_line_model_errors
def cmd_perplexity(args) -> int:
    from leanstream_ggml.native import modes

    from . import perplexity, systems
    from .bench import DEFAULT_TEXT

    check_params(args)
    model = resolve(args.model)
    text = Path(args.text or DEFAULT_TEXT)   # a text, or .jsonl chats in the model's template
    n_threads = args.threads or len(os.sched_getaffinity(0))
    common = dict(n_ctx=args.ctx_size, n_threads=n_threads, n_batch=max(args.batch_size, args.ctx_size),
                  logits_all=True)
    system = args.system or systems.detect_system(model)
    llm = systems.open_model(model, system, mode=args.mode, memory_budget=args.memory_budget,
                             extra=engine_extra(args, system), **common)
    decode = args.decode if args.decode is not None else (system == systems.PLUGIN and modes.is_sparse(args.mode))
    out = {"model": str(model), "system": system, "mode": args.mode if system == systems.PLUGIN else None,
           "decode_scored": decode, **engine_extra(args, system),
           "stock": systems.stock_description(), "text": str(args.text or DEFAULT_TEXT), "n_threads": n_threads}
    if args.reference:
        ref_path = resolve(args.reference)
        ref = systems.open_model(ref_path, systems.STOCK, **common)
        out["reference"] = str(ref_path)
        out.update(perplexity.compare(llm, ref, text, args.ctx_size, args.chunks, decode=decode))
    else:
        out.update(perplexity.perplexity(llm, text, args.ctx_size, args.chunks, decode=decode).to_dict())
    emit(args, out)
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        print(f"{Path(out['model']).name} ({system}{', ' + args.mode if out['mode'] else ''}): "
              f"PPL = {out['ppl']:.4f} over {out['n_scored']} tokens in {out['n_chunks']} windows of {args.ctx_size}")
        if args.reference:
            print(f"reference {Path(out['reference']).name} (stock): PPL = {out['ppl_reference']:.4f}; "
                  f"ratio {out['ppl_ratio']:.4f}; top-1 agreement {out['top1_agreement']:.4f}; "
                  f"mean KL {out['kl_mean']:.5f} (max {out['kl_max']:.4f})")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m leanstream_tools.cli")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    register(sub)
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
