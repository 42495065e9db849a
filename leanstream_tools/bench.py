"""`leanstream bench`: prefill and decode throughput of one system, llama-bench style.

One repetition = clear the context, prefill ``n_prompt`` tokens of the prompt text in batches of
``n_batch`` (timed: prefill tok/s), then greedily decode ``n_gen`` tokens one at a time (timed:
decode tok/s; each step is one llama_decode of one token plus an argmax over the vocabulary).
The reported value is the median over repetitions; every repetition is kept in the JSON.

Differences from llama-bench, on purpose: the prompt is real text (the bundled held-out text by
default), not random token ids, because a sparse engine's predictor and cache behave differently
on noise; and decode is greedy continuation of that prompt, so the generated tokens double as a
correctness check between systems (`generated` in the JSON). There is no separate warm-up run:
the first repetition is the cold one (its disk reads show in `disk_read_bytes`), the median is
the steady state.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np

from . import measure, systems

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "heldout-technical.txt"


def prompt_tokens(llm, text: str, n: int) -> list[int]:
    """The first ``n`` tokens of ``text`` (BOS first where the model's vocabulary asks for it),
    repeated if the text is too short."""
    toks = llm.tokenize(text.encode("utf-8"), add_bos=True)
    if not toks:
        raise ValueError("the prompt text tokenizes to nothing")
    while len(toks) < n:
        toks = toks + toks
    return toks[:n]


def last_logits(llm) -> np.ndarray:
    """Logits of the last evaluated token (a view into llama.cpp's buffer; copy to keep)."""
    from leanstream_ggml.llamacpp import context

    return context.logits(llm)


def run_bench(llm, prompt: list[int], n_gen: int, repetitions: int = 3) -> dict:
    """Time ``repetitions`` rounds of prefill(prompt) + greedy decode(n_gen) on an open Llama."""
    if len(prompt) + n_gen > llm.n_ctx():
        raise ValueError(f"n_prompt + n_gen = {len(prompt) + n_gen} exceeds n_ctx = {llm.n_ctx()}")
    reps = []
    io_before = measure.disk_read_bytes()
    for _ in range(repetitions):
        llm.reset()
        systems.reset_engine_stats(llm)
        r0 = measure.disk_read_bytes()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        r1 = measure.disk_read_bytes()
        eng_prefill = systems.engine_stats(llm)
        systems.reset_engine_stats(llm)
        tok = int(np.argmax(last_logits(llm)))
        generated = [tok]
        t2 = time.perf_counter()
        if getattr(llm, "speculative", "off") != "off":
            # decode through generate, where speculative decoding drafts and verifies (greedy: the
            # same tokens); its first token is the argmax above, from the prompt already evaluated
            gen = llm.generate(prompt + [tok], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
            for t in gen:
                generated.append(int(t))
                if len(generated) > n_gen:
                    break
            gen.close()
        else:
            for _ in range(n_gen):
                llm.eval([tok])
                tok = int(np.argmax(last_logits(llm)))
                generated.append(tok)
        t3 = time.perf_counter()
        r2 = measure.disk_read_bytes()
        reps.append({
            "prefill_s": t1 - t0, "decode_s": t3 - t2,
            "prefill_tok_s": len(prompt) / (t1 - t0) if prompt else None,
            "decode_tok_s": n_gen / (t3 - t2) if n_gen else None,
            "disk_read_bytes_prefill": None if r0 is None else r1 - r0,
            "disk_read_bytes_decode": None if r0 is None else r2 - r1,
            "engine_prefill": eng_prefill,
            "engine_decode": systems.engine_stats(llm),
            "generated": generated[:-1],  # the n_gen tokens fed back (the last argmax was not evaluated)
        })
    io_after = measure.disk_read_bytes()

    def med(key):
        vals = [r[key] for r in reps if r[key] is not None]
        return statistics.median(vals) if vals else None

    def best(key):
        vals = [r[key] for r in reps if r[key] is not None]
        return max(vals) if vals else None

    dec_bytes = [r["disk_read_bytes_decode"] for r in reps if r["disk_read_bytes_decode"] is not None]
    return {
        "prefill_tok_s": med("prefill_tok_s"),
        "decode_tok_s": med("decode_tok_s"),
        # on a shared machine other work only ever slows a repetition down: the best one is the
        # least disturbed (reported beside the median, never instead of it)
        "prefill_tok_s_best": best("prefill_tok_s"),
        "decode_tok_s_best": best("decode_tok_s"),
        "disk_read_bytes_total": None if io_before is None else io_after - io_before,
        "disk_read_bytes_per_decode_token": (statistics.median(dec_bytes) / n_gen) if dec_bytes and n_gen else None,
        "generated": reps[-1]["generated"],
        "engine_prefill": reps[-1]["engine_prefill"],
        "engine_decode": reps[-1]["engine_decode"],
        "repetitions": [{k: v for k, v in r.items() if k not in ("generated", "engine_prefill", "engine_decode")}
                        for r in reps],
    }


def bench(model_path, system: str | None = None, *, n_prompt: int = 128, n_gen: int = 32,
          repetitions: int = 3, n_threads: int | None = None, n_ctx: int | None = None, n_batch: int = 512,
          mode: str = "dense", memory_budget=None, text_path=None, extra: dict | None = None) -> dict:
    """Load a model as ``system``, benchmark it, and return one JSON-able dict (the process's
    counters included: call this in a fresh process for a clean peak RSS)."""
    system = system or systems.detect_system(model_path)
    n_threads = n_threads or len(os.sched_getaffinity(0))
    n_ctx = n_ctx or max(512, n_prompt + n_gen)
    text = Path(text_path or DEFAULT_TEXT).read_text(encoding="utf-8")
    io0 = measure.disk_read_bytes()
    t0 = time.perf_counter()
    llm = systems.open_model(model_path, system, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch,
                             mode=mode, memory_budget=memory_budget, extra=extra)
    load_s = time.perf_counter() - t0
    io1 = measure.disk_read_bytes()
    rss_after_load = measure.proc_status().get("VmRSS")
    prompt = prompt_tokens(llm, text, n_prompt)
    res = run_bench(llm, prompt, n_gen, repetitions)
    status = measure.proc_status()
    files = measure.model_files(model_path)
    out = {
        "system": system,
        "mode": mode if system == systems.PLUGIN else None, **(extra or {}),
        "stock": systems.stock_description(),
        "model": str(model_path),
        "model_bytes": measure.files_size(files),
        "memory_budget_bytes": (llm.engine.memory_budget if getattr(llm, "memory_plan", None) is not None
                                else measure.parse_size(memory_budget) if system == systems.PLUGIN else None),
        "memory_plan": (plan.to_dict() if (plan := getattr(llm, "memory_plan", None)) is not None else None),
        "n_prompt": n_prompt, "n_gen": n_gen, "repetitions_n": repetitions,
        "n_threads": n_threads, "n_ctx": n_ctx, "n_batch": n_batch,
        "load_s": load_s,
        "disk_read_bytes_load": None if io0 is None else io1 - io0,
        "rss_after_load_bytes": rss_after_load,
        "peak_rss_bytes": status.get("VmHWM"),
        "rss_end_bytes": status.get("VmRSS"),
        "engine_total": systems.engine_stats(llm),
        **res,
        "machine": measure.machine_info(),
    }
    close = getattr(llm, "close", None)
    if close:
        close()
    return out


def format_table(results: list[dict]) -> str:
    """A llama-bench-like Markdown table of one or more `bench` results."""
    rows = ["| model | size | system | threads | test | t/s | peak RSS | disk read |",
            "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: |"]
    for r in results:
        name = Path(r["model"]).name
        sysname = r["system"] + (f" ({r['mode']})" if r.get("mode") else "")
        for test, key, n, bkey in (("pp", "prefill_tok_s", r["n_prompt"], "disk_read_bytes_prefill"),
                                   ("tg", "decode_tok_s", r["n_gen"], "disk_read_bytes_decode")):
            v = r.get(key)
            reps = [x[key] for x in r["repetitions"] if x.get(key) is not None]
            sd = statistics.stdev(reps) if len(reps) > 1 else 0.0
            rd = [x[bkey] for x in r["repetitions"] if x.get(bkey) is not None]
            rows.append(f"| {name} | {measure.format_size(r['model_bytes'])} | {sysname} | {r['n_threads']} "
                        f"| {test}{n} | {v:.2f} ± {sd:.2f} | {measure.format_size(r['peak_rss_bytes'])} "
                        f"| {measure.format_size(int(statistics.median(rd))) if rd else 'n/a'} |"
                        if v is not None else f"| {name} | | {sysname} | | {test}{n} | n/a | | |")
    return "\n".join(rows)
