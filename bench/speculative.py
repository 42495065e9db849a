"""Speculative decoding against plain decoding and stock llama-cpp-python, interleaved.

    python bench/speculative.py MODEL_DIR --gguf MODEL.gguf --regimes 1000MB,ram \
        --configs off,auto,self,self:fixed,self:pmin0.75,ngram,stock,stock+ngram,q3_k_m+ngram \
        --prompts 3 --max-tokens 96 --rounds 1 --out bench/results/speculative-....json

A regime is "ram" (no limit) or a whole-process limit ("1000MB": each run in its own memory
cgroup of exactly that many bytes, the engine's budget from the memory plan). A config is
plugin dense with ``speculative=`` KIND[:kN][:wN][:fN][:fixed|:pminX] (KIND off, auto, self or ngram;
kN: draft_max N; wN: draft_width N (1: a chain); fN: draft_fraction N; fixed: always draft
draft_max, every drafted token verified; pminX: llama.cpp's p_min stop; fa: flash attention, the
plugin's default in every config; stream: in_ram="stream", the op in RAM too), or stock
llama-cpp-python on the GGUF ("stock") or on a re-quantized copy ("q3_k_m"), "+ngram": with its
prompt lookup draft (LlamaPromptLookupDecoding, n-grams <= 3, 8 tokens).

Every run is a fresh process with the model's files dropped from the page cache first (cold):
for each prompt (--prompt-file: bench/data/speculative-prompts.json, the development set, or
speculative-heldout.json, the held-out one) the chat template's prompt, then greedy decoding of up to --max-tokens tokens
through ``generate`` (the loop completion and chat use). Decode tok/s = (tokens - 1) / (time
from the first token to the last). Per round every (regime, config) runs once, back to back.

Prints one JSON document: the runs (per prompt: tokens, decode tok/s, the speculative counters)
and a summary per regime and domain: decode tok/s (all tokens / all decode time), the ratio to
"off" (plain dense), agreement with plain decoding ("off:fa" where it ran, else "off": answer
tokens equal up to the first divergence, over all tokens), and for each divergence the logit margin there of the plain dense model
between its token and the other (a near-tie is a margin below ~0.5).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import benchkit

PROMPTS = Path(__file__).resolve().parent / "data" / "speculative-prompts.json"
REF = "off:fa"   # plain decoding with the attention speculative decoding uses: the answers to match


def parse_config(config: str) -> dict:
    """"self:k4:fixed" -> {"system": "plugin", "speculative": "self", "draft_max": 4, "draft_stop": "fixed"}."""
    system, _, lookup = config.partition("+")
    if system in ("stock", "q3_k_m", "q2_k"):
        if lookup not in ("", "ngram"):
            raise SystemExit(f"bad config {config!r}: a stock config may end in +ngram only")
        return {"system": system, "lookup": lookup == "ngram"}
    kind, *opts = config.split(":")
    out = {"system": "plugin", "speculative": kind}
    for o in opts:
        if o.startswith("k") and o[1:].isdigit():
            out["draft_max"] = int(o[1:])
        elif o.startswith("w") and o[1:].isdigit():
            out["draft_width"] = int(o[1:])
        elif o == "fixed":
            out["draft_stop"] = "fixed"
        elif o.startswith("pmin"):
            out["draft_stop"] = f"p_min:{float(o[4:])}"
        elif o == "fa":
            out["flash_attn"] = True
        elif o == "stream":
            out["in_ram"] = "stream"
        elif o.startswith("f") and o[1:].replace(".", "", 1).isdigit():
            out["draft_fraction"] = float(o[1:])
        else:
            raise SystemExit(f"bad config {config!r}: unknown option {o!r}")
    return out


def chat_prompt_tokens(llm, text: str) -> list[int]:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    tmpl = llm.metadata["tokenizer.chat_template"]
    eos = llm.detokenize([llm.token_eos()], special=True).decode()
    bos = llm.detokenize([llm.token_bos()], special=True).decode()
    f = Jinja2ChatFormatter(template=tmpl, eos_token=eos, bos_token=bos)(messages=[{"role": "user", "content": text}])
    return llm.tokenize(f.prompt.encode(), add_bos=not f.added_special, special=True)


def greedy(llm, tokens: list[int], max_tokens: int) -> tuple[list[int], float | None, float | None]:
    """Greedy decoding through ``generate`` (the loop completion and chat use): the answer (up to
    max_tokens tokens, EOS excluded), the prefill's seconds (to the first token) and the decode's
    (from the first token to the last; None under two tokens)."""
    out, stamps = [], []
    t_start = time.perf_counter()
    for tok in llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter())
        if tok == llm.token_eos() or len(out) >= max_tokens:
            break
        out.append(int(tok))
    n = len(out)
    return (out, stamps[0] - t_start if stamps else None,
            stamps[min(n, len(stamps) - 1)] - stamps[0] if n > 1 else None)


def child(a: dict) -> dict:
    cfg = parse_config(a["config"])
    t0 = time.perf_counter()
    if cfg["system"] == "plugin":
        from leanstream_ggml import Llama

        kw = {k: cfg[k] for k in ("speculative", "draft_max", "draft_width", "draft_stop", "draft_fraction", "flash_attn", "in_ram") if k in cfg}
        if a["regime"] != "ram":
            kw["memory_limit"] = a["regime"]
        llm = Llama(a["model"], n_ctx=a["ctx"], n_threads=a["threads"], n_threads_batch=a["threads"],
                    verbose=False, mode="dense", **kw)
    else:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=8) if cfg["lookup"] else None
        llm = llama_cpp.Llama(a["gguf"][cfg["system"]], n_ctx=a["ctx"], n_threads=a["threads"],
                              n_threads_batch=a["threads"], verbose=False, draft_model=draft)
    load_s = time.perf_counter() - t0
    backend = getattr(llm, "backend", "llama_cpp")
    runs = []
    try:
        for domain, text in a["prompts"]:
            toks = chat_prompt_tokens(llm, text)
            if hasattr(llm, "reset_stats"):
                llm.reset_stats()
            out, prefill_s, decode_s = greedy(llm, toks, a["max_tokens"])
            r = {"domain": domain, "prompt_tokens": toks, "tokens": out, "prefill_s": prefill_s, "decode_s": decode_s,
                 "decode_tps": (len(out) - 1) / decode_s if decode_s else None}
            if getattr(llm, "backend", None) == "stream":   # (the stock backend counts nothing)
                s = llm.stats()
                r["speculative"] = s.get("speculative")
                # per row the engine computed (a verify pass's rows each count) and per answer token
                # (the prompt's pass included): the same for `off`, not with speculation
                r["mb_read_per_token"] = s["bytes_read"] / max(1, s["tokens"]) / 1e6
                r["mb_read_per_answer_token"] = s["bytes_read"] / max(1, len(out)) / 1e6
            runs.append(r)
    finally:
        llm.close()
    return {"load_s": load_s, "backend": backend, "prompts": runs}


def child_passes(a: dict) -> dict:
    """--passes: one decode of B tokens after a 64-token prompt, with logits for all B, then
    removed from the KV cache; the median of 3 per B (what a verify pass of B rows costs)."""
    from leanstream_ggml import Llama

    cfg = parse_config(a["config"])
    kw = {k: cfg[k] for k in ("speculative", "draft_max", "draft_stop") if k in cfg}
    if a["regime"] != "ram":
        kw["memory_limit"] = a["regime"]
    llm = Llama(a["model"], n_ctx=a["ctx"], n_threads=a["threads"], n_threads_batch=a["threads"], verbose=False,
                mode="dense", **kw)
    try:
        toks = chat_prompt_tokens(llm, a["prompts"][0][1])[:64]
        llm.eval(toks)
        out = {}
        for b in [1] + [x for x in a["passes"] if x != 1] * 3 + [1, 1]:
            batch = toks[-b:] if b <= len(toks) else (toks * b)[:b]
            t0 = time.perf_counter()
            llm.eval_all_rows(batch)      # all B rows' logits, as a verify pass
            out.setdefault(b, []).append(time.perf_counter() - t0)
            llm.rewind(llm.n_tokens - b)
        return {"pass_s": {b: statistics.median(v[1:] if b == 1 else v) for b, v in out.items()}}
    finally:
        llm.close()


def run(a: dict, timeout_s: float = 3600) -> dict:
    from leanstream_tools import measure

    files = measure.model_files(a["model"]) + [Path(p) for p in a["gguf"].values()]
    measure.drop_page_cache(files)
    out, r = benchkit.run_child(__file__, a, limit_bytes=benchkit.regime_limit(a["regime"]), timeout_s=timeout_s,
                                account=True)
    peak = r.cgroup.get("max_usage_bytes")
    if "error" in out:
        return {**out, "peak_bytes": peak, "wall_s": r.wall_s}
    out.update(peak_bytes=peak, wall_s=r.wall_s, oom_kill=r.cgroup.get("oom_kill", 0))
    return out


def agreement(ref: list[int], got: list[int]) -> tuple[int, int]:
    """(tokens equal up to the first divergence, tokens compared)."""
    n = min(len(ref), len(got))
    same = next((i for i in range(n) if ref[i] != got[i]), n)
    return same, max(len(ref), len(got))


def margins(model: str, runs: list[dict], threads: int) -> None:
    """For every answer that diverges from plain dense decoding: plain dense's logit margin at the
    first divergence between its token and the other one (in RAM, one prefix eval each)."""
    import numpy as np

    from leanstream_ggml import Llama

    todo = [p for r in runs for p in r.get("prompts", []) if p.get("divergence")]
    if not todo:
        return
    llm = Llama(model, n_ctx=1024, n_threads=threads, verbose=False, mode="dense", speculative="off")
    try:
        for r in todo:
            d = r["divergence"]
            llm.reset()
            llm.eval(d["prefix"])
            logits = llm.logits()
            d["margin"] = float(logits[d["plain"]] - logits[d["other"]])
            d["plain_is_argmax"] = int(np.argmax(logits)) == d["plain"]
            del d["prefix"]
    finally:
        llm.close()


def summarize(doc: dict) -> list[dict]:
    runs, out = doc["runs"], []
    for regime in dict.fromkeys(r["regime"] for r in runs):
        for domain in ("code", "chat"):
            rows, ref = {}, {}
            ref_config = REF if any(r["config"] == REF for r in runs) else "off"
            for r in runs:
                if r["regime"] != regime or "error" in r or r["config"] != ref_config:
                    continue
                for i, p in enumerate(q for q in r["prompts"] if q["domain"] == domain):
                    ref.setdefault(i, p["tokens"])
            for config in dict.fromkeys(r["config"] for r in runs if r["regime"] == regime):
                rs = [r for r in runs if r["regime"] == regime and r["config"] == config]
                ok = [r for r in rs if "error" not in r]
                if not ok:
                    rows[config] = {"error": rs[0]["error"], "peak_mb": (rs[0].get("peak_bytes") or 0) / 1e6}
                    continue
                ps = [[q for q in r["prompts"] if q["domain"] == domain] for r in ok]
                toks = sum(len(q["tokens"]) - 1 for p in ps for q in p if q["decode_s"])
                secs = sum(q["decode_s"] for p in ps for q in p if q["decode_s"])
                row = {"decode_tps": toks / secs if secs else None,
                       "decode_tps_by_round": [sum(len(q["tokens"]) - 1 for q in p if q["decode_s"]) /
                                               max(1e-9, sum(q["decode_s"] for q in p if q["decode_s"])) for p in ps],
                       "peak_mb": max((r.get("peak_bytes") or 0) for r in ok) / 1e6,
                       "oom_kills": sum(r.get("oom_kill", 0) for r in ok)}
                same = total = 0
                for p in ps:
                    for i, q in enumerate(p):
                        if i in ref:
                            s, t = agreement(ref[i], q["tokens"])
                            same, total = same + s, total + t
                row["agreement_with_plain"] = same / total if total else None
                sp = [q["speculative"] for p in ps for q in p if q.get("speculative")]
                if sp and sum(x["passes"] + x["plain_passes"] for x in sp):
                    passes = sum(x["passes"] for x in sp)
                    row["speculative"] = {
                        "passes": passes, "plain_passes": sum(x["plain_passes"] for x in sp),
                        "drafted": sum(x["drafted"] for x in sp), "accepted": sum(x["accepted"] for x in sp),
                        "tokens_per_pass": (sum(x["accepted"] for x in sp) + passes) / passes if passes else 1.0,
                        "acceptance": sum(x["accepted"] for x in sp) / max(1, sum(x["drafted"] for x in sp)),
                        "draft_s": sum(x["draft_time_s"] for x in sp), "verify_s": sum(x["verify_time_s"] for x in sp),
                        "draft_steps": sum(x["draft_steps"] for x in sp)}
                    # the share of decode time spent drafting, and the rate if drafting cost nothing
                    # (every pass as it was, the draft hidden under it): the most overlapping the
                    # draft with the verify pass could give at these tokens per pass
                    d_s = row["speculative"]["draft_s"]
                    row["speculative"]["draft_share"] = d_s / secs if secs else None
                    row["speculative"]["tps_if_draft_free"] = toks / (secs - d_s) if secs > d_s else None
                    by_kind = {}
                    for x in sp:
                        for k, n in x["proposals"].items():
                            a = by_kind.setdefault(k, [0, 0])
                            a[0], a[1] = a[0] + n, a[1] + (x.get("tokens_by_kind") or {}).get(k, 0)
                    row["speculative"]["passes_by_kind"] = {k: a[0] for k, a in by_kind.items()}
                    if all("tokens_by_kind" in x for x in sp):
                        row["speculative"]["tokens_per_pass_by_kind"] = {k: a[1] / a[0] for k, a in by_kind.items() if a[0]}
                    by_n = {}
                    for x in sp:
                        for n, v in (x.get("lookup_by_ngram") or {}).items():
                            a = by_n.setdefault(n, [0, 0.0])
                            a[0], a[1] = a[0] + v["passes"], a[1] + v["passes"] * v["first_hit"]
                    if by_n:
                        row["speculative"]["lookup_by_ngram"] = {
                            n: {"passes": a[0], "first_hit": round(a[1] / a[0], 3)} for n, a in sorted(by_n.items()) if a[0]}
                row["divergences"] = [q["divergence"] for p in ps for q in p if q.get("divergence")]
                rows[config] = row
            base = rows.get("off", {}).get("decode_tps")
            for row in rows.values():
                if base and row.get("decode_tps"):
                    row["ratio_to_off"] = row["decode_tps"] / base
                    free = row.get("speculative", {}).get("tps_if_draft_free")
                    if free:
                        row["speculative"]["ratio_if_draft_free"] = free / base
            out.append({"regime": regime, "domain": domain, "configs": rows})
    return out


def main(argv=None) -> int:
    ap = benchkit.parser(__doc__, child=True)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--gguf", default=None, help="the source GGUF (stock configs)")
    ap.add_argument("--regimes", default="1000MB,ram")
    ap.add_argument("--configs", default="off,auto,self,ngram")
    ap.add_argument("--domains", default="code,chat")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per domain")
    ap.add_argument("--prompt-file", default=str(PROMPTS),
                    help="the prompts (JSON: {domain: [text, ...]}); default the development set, "
                         "bench/data/speculative-heldout.json the held-out one")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", default=None, help="instead: time passes of these batch sizes, e.g. 1,2,3,5,9")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.child:
        return benchkit.answer_child(args.child, lambda a: child_passes(a) if a.get("passes") else child(a))
    data = json.loads(Path(args.prompt_file).read_text())
    prompts = [(d, t) for d in args.domains.split(",") for t in data[d][:args.prompts]]
    configs = args.configs.split(",")
    gguf = {}
    for c in configs:
        cfg = parse_config(c)
        if cfg["system"] != "plugin":
            if not args.gguf:
                raise SystemExit(f"config {c!r} needs --gguf")
            if cfg["system"] == "stock":
                gguf["stock"] = str(Path(args.gguf).resolve())
            else:
                from leanstream_tools import quants

                gguf[cfg["system"]] = str(quants.requantize(args.gguf, cfg["system"].upper(), n_threads=args.threads))
    base = {"model": args.model, "gguf": gguf, "threads": args.threads, "max_tokens": args.max_tokens,
            "ctx": args.ctx, "prompts": prompts}
    if args.passes:
        base["passes"] = [int(x) for x in args.passes.split(",")]
    from leanstream_tools.measure import machine_info

    doc = {"model": args.model, "args": vars(args), "machine": machine_info(), "runs": []}
    for rnd in range(args.rounds):
        for regime in args.regimes.split(","):
            for config in configs:
                r = run({**base, "regime": regime, "config": config})
                r.update(regime=regime, config=config, round=rnd)
                brief = {k: v for k, v in r.items() if k != "prompts"}
                brief["decode_tps"] = [p["decode_tps"] for p in r.get("prompts", [])]
                print(json.dumps(brief), file=sys.stderr, flush=True)
                doc["runs"].append(r)
    if args.passes:
        return benchkit.emit(doc, args.out)
    # divergences from plain dense decoding (same regime, same prompt), and their margins
    for r in doc["runs"]:
        if "error" in r or r["config"] in ("off", REF) or not parse_config(r["config"])["system"] == "plugin":
            continue
        ref = next((o for o in doc["runs"] if o["regime"] == r["regime"] and o["config"] == REF and "error" not in o), None) \
            or next((o for o in doc["runs"] if o["regime"] == r["regime"] and o["config"] == "off" and "error" not in o), None)
        if ref is None:
            continue
        for p, q in zip(r["prompts"], ref["prompts"]):
            same, _ = agreement(q["tokens"], p["tokens"])
            if same < min(len(q["tokens"]), len(p["tokens"])):
                p["divergence"] = {"at": same, "plain": q["tokens"][same], "other": p["tokens"][same],
                                   "prefix": q["prompt_tokens"] + q["tokens"][:same]}
    margins(args.model, doc["runs"], args.threads)
    for r in doc["runs"]:
        for p in r.get("prompts", []):
            p.pop("prompt_tokens", None)
    doc["summary"] = summarize(doc)
    return benchkit.emit(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
