"""`leanstream bench` and `leanstream perplexity` (llama-bench / llama-perplexity for both systems).

    leanstream bench model.lsm -p 128 -n 32 -r 3 --memory-budget 512MiB --json
    leanstream bench model.gguf                       # the same, stock llama-cpp-python
    leanstream perplexity model.lsm --reference model.gguf --json
    leanstream perplexity model.gguf                  # stock perplexity, computed identically

MODEL is a model directory (leanstream), a GGUF file (stock) or a model recipe name
(`smollm2-135m-instruct`, `qwen2.5-coder-1.5b-instruct`, `gemma3-270m`: the cached GGUF, stock).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _resolve(model: str) -> Path:
    import errno

    from leanstream_ggml import models

    p = models.resolve(model)
    if not p.exists():
        raise FileNotFoundError(errno.ENOENT, "no such model directory, GGUF file or model name", str(p))
    return p


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (leanstream), GGUF file (stock) or recipe name")
    p.add_argument("--system", choices=("stock", "leanstream"), default=None,
                   help="default: leanstream for a directory, stock for a GGUF")
    p.add_argument("--mode", default="dense", help="leanstream engine mode (default: dense)")
    p.add_argument("--memory-budget", default=None, help="leanstream weight budget, e.g. 512MiB (default: none)")
    p.add_argument("--memory-limit", default=None,
                   help="leanstream: instead of --memory-budget, a limit for the whole process, e.g. 1000MB: the "
                        "memory plan gives the FFN engine what the rest of the process leaves (`leanstream info "
                        "MODEL --memory-limit` prints it)")
    p.add_argument("--sparsity", type=float, default=None, help="sparse modes: fraction of blocks skipped (default 0.5)")
    p.add_argument("--quality", default=None,
                   help='instead of --sparsity: the perplexity loss accepted, e.g. "ppl+5%%" (leanstream mode; '
                        "the sparsity is read from the converter's calibration)")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: cores available)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="n_batch (= n_ubatch)")
    p.add_argument("--json", action="store_true", help="print one JSON document on one line")
    p.add_argument("--verify-checksums", action=argparse.BooleanOptionalAction, default=True,
                   help="leanstream: check each block's CRC-32C as it is read (default: on; off only to "
                        "measure what the check costs)")


def register(subparsers) -> None:
    from leanstream_ggml.options import add_flags

    b = subparsers.add_parser("bench", help="prefill/decode tokens/s, peak RSS, disk bytes (llama-bench style)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(b)
    add_flags(b, "bench")
    b.add_argument("-p", "--n-prompt", type=int, default=128, help="prompt tokens (prefill test)")
    b.add_argument("-n", "--n-gen", type=int, default=32, help="generated tokens (decode test)")
    b.add_argument("-r", "--repetitions", type=int, default=3, help="repetitions; medians are reported")
    b.add_argument("-c", "--ctx-size", type=int, default=None, help="n_ctx (default: max(512, p + n))")
    b.add_argument("--text", default=None, help="prompt text file (default: the bundled held-out text)")
    b.set_defaults(func=cmd_bench)

    q = subparsers.add_parser("perplexity", help="perplexity on a text; agreement and KL vs a reference",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(q)
    q.add_argument("--text", default=None, help="text file (default: the bundled held-out technical text)")
    q.add_argument("-c", "--ctx-size", type=int, default=512, help="window size n_ctx (second half is scored)")
    q.add_argument("--chunks", type=int, default=None, help="at most this many windows")
    q.add_argument("--decode", action=argparse.BooleanOptionalAction, default=None,
                   help="score the second half of each window token by token, as generation runs "
                        "(default: on for the sparse modes, which are sparse only there)")
    q.add_argument("--reference", default=None,
                   help="GGUF (or recipe name) run with stock llama-cpp-python over the same windows: "
                        "adds top-1 agreement and mean KL")
    q.set_defaults(func=cmd_perplexity)


def _engine_extra(args, system: str) -> dict:
    """--sparsity as a Llama keyword argument (leanstream only)."""
    if system != "leanstream":
        if getattr(args, "memory_limit", None) is not None:
            from leanstream_ggml import params

            raise params.ParameterError("memory_limit", "plans the plugin's memory; stock llama.cpp takes no "
                                                        "limit (run it in a memory cgroup: `leanstream compare`)")
        return {}
    from leanstream_ggml.options import given

    out = {"sparsity": args.sparsity} if args.sparsity is not None else {}
    out.update(given(args, args.command))
    if getattr(args, "quality", None) is not None:
        out["quality"] = args.quality
    if not args.verify_checksums:
        out["verify_checksums"] = False
    if getattr(args, "memory_limit", None) is not None:
        out["memory_limit"] = args.memory_limit
    return out


def _check_params(args) -> None:
    """--memory-budget, --mode, --sparsity through the one validator (params.py):
    a bad value is one line naming it, before any model is opened."""
    from leanstream_ggml import params

    if getattr(args, "quality", None) is not None:
        if args.sparsity is not None:
            raise params.ParameterError("quality", "give --quality or --sparsity, not both")
        params.quality(args.quality)   # a bad value: one line, before any model is opened
        if args.mode == "dense":
            args.mode = "leanstream"   # quality= chooses leanstream mode's sparsity
    p = params.engine_params(memory_budget=args.memory_budget, mode=args.mode, sparsity=args.sparsity)
    args.memory_budget = p["memory_budget"] or None     # bytes (None: no limit), one parser for all reports
    if args.memory_limit is not None:
        if args.memory_budget is not None:
            raise params.ParameterError("memory_limit", "give --memory-limit or --memory-budget, not both")
        args.memory_limit = params.size_bytes(args.memory_limit, "memory_limit") or None


def _one_line_model_errors(fn):
    """llama-cpp-python reports a model it cannot load as ValueError: one line, like every
    other user error (leanstream_ggml/errors.py)."""
    import functools

    @functools.wraps(fn)
    def run(args):
        try:
            return fn(args)
        except ValueError as e:
            print(f"leanstream {args.command}: {e}", file=sys.stderr)
            return 1
    return run


@_one_line_model_errors
def cmd_bench(args) -> int:
    from . import bench, systems

    _check_params(args)
    model = _resolve(args.model)
    r = bench.bench(model, args.system, n_prompt=args.n_prompt, n_gen=args.n_gen, repetitions=args.repetitions,
                    n_threads=args.threads, n_ctx=args.ctx_size, n_batch=args.batch_size, mode=args.mode,
                    memory_budget=args.memory_budget, text_path=args.text,
                    extra=_engine_extra(args, args.system or systems.detect_system(model)))
    if args.json:
        print(json.dumps(r), flush=True)
    else:
        print(bench.format_table([r]))
        eng = r.get("engine_decode")
        if eng:
            print("engine (decode, last repetition): " + ", ".join(f"{k}={v}" for k, v in eng.items()))
    return 0


@_one_line_model_errors
def cmd_perplexity(args) -> int:
    from . import perplexity, systems
    from .bench import DEFAULT_TEXT

    _check_params(args)
    model = _resolve(args.model)
    text = Path(args.text or DEFAULT_TEXT).read_text(encoding="utf-8")
    n_threads = args.threads or len(os.sched_getaffinity(0))
    common = dict(n_ctx=args.ctx_size, n_threads=n_threads, n_batch=max(args.batch_size, args.ctx_size),
                  logits_all=True)
    system = args.system or systems.detect_system(model)
    llm = systems.open_model(model, system, mode=args.mode, memory_budget=args.memory_budget,
                             extra=_engine_extra(args, system), **common)
    decode = args.decode if args.decode is not None else (system == "leanstream" and args.mode != "dense")
    out = {"model": str(model), "system": system, "mode": args.mode if system == "leanstream" else None,
           "decode_scored": decode, **_engine_extra(args, system),
           "stock": systems.stock_description(), "text": str(args.text or DEFAULT_TEXT), "n_threads": n_threads}
    if args.reference:
        ref_path = _resolve(args.reference)
        ref = systems.open_model(ref_path, "stock", **common)
        out["reference"] = str(ref_path)
        out.update(perplexity.compare(llm, ref, text, args.ctx_size, args.chunks, decode=decode))
    else:
        out.update(perplexity.perplexity(llm, text, args.ctx_size, args.chunks, decode=decode).to_dict())
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
    ap = argparse.ArgumentParser(prog="python -m leanstream_ggml.harness.cli")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    register(sub)
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
