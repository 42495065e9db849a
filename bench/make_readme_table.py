"""Markdown tables for the README from side-by-side JSON files (bench/side_by_side.py --out).

    python bench/make_readme_table.py bench/results/side_by_side-*.json

One table per JSON file: a header line (model, machine class, date, settings), then for every
memory limit one row per system: its model file, held-out perplexity (when measured, with the
ratio to stock's), decode tok/s, peak RSS and disk bytes read per decode token; failed runs show
their status (oom, timeout, error, skipped). Decode tok/s is the median over repetitions, with
the best repetition in parentheses. Standard library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _mb(n) -> str:
    if n is None:
        return "–"
    if n >= 10**9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.0f} MB"


def _limit(n) -> str:
    return "none" if n is None else f"{n / 1e6:.0f} MB"


def _system_name(s: str, doc: dict) -> str:
    if s == "stock" or s.startswith("stock-"):
        f = (doc.get("stock_files") or {}).get(s, {}).get("file") or (doc["model"] if s == "stock" else s[6:].upper())
        q = _quant_of(f)
        return f"stock {q}" if q else s
    return f"leanstream {s}"


def _quant_of(filename: str) -> str | None:
    """"Qwen.Q3_K_M-from-Q4_K_M.gguf" -> "Q3_K_M", "SmolLM2.Q4_1.gguf" -> "Q4_1"."""
    stem = filename[:-5] if filename.endswith(".gguf") else filename
    last = stem.rsplit(".", 1)[-1].split("-from-")[0]
    return last.upper() if last[:1] in "qQfF" and any(c.isdigit() for c in last) else None


def _ppl_cell(doc: dict, s: str) -> str:
    ppl = doc.get("perplexity") or {}
    p, ref = (ppl.get(s) or {}).get("ppl"), (ppl.get("stock") or {}).get("ppl")
    if p is None:
        return "–"
    return f"{p:.2f}" + (f" (×{p / ref:.3f})" if ref and s != "stock" else "")


def table(doc: dict) -> str:
    m, st = doc["machine"], doc["settings"]
    cg = doc["cgroup"]
    head = (f"**{doc['model']}** ({_mb(doc['model_bytes'])}) — {m['cores']}-core {m['cpu']}, "
            f"{_mb(m.get('mem_total_bytes'))} RAM, {m['date']}; {st['n_threads']} threads, "
            f"prompt {st['n_prompt']} / generate {st['n_gen']} tokens, median of {st['repetitions']}, "
            f"n_ctx {st['n_ctx']}; page cache dropped before each run: {'yes' if st['page_cache_dropped'] else 'no'}; "
            + ("limits: a child memory cgroup per run (v1 memory.limit_in_bytes, page cache included)."
               if cg["writable"] else f"**no limits applied** (cgroups not writable: {cg.get('reason')})."))
    if doc.get("stock"):
        head += f" Stock = {doc['stock']}."
    loads = [e["loadavg_1min_at_start"] for e in doc["runs"] if e.get("loadavg_1min_at_start") is not None]
    if loads:
        head += (f" Machine load (1-min load average at the start of each run) {min(loads):.1f}–{max(loads):.1f}"
                 f" on {m['cores']} cores: other work shared the CPUs, so compare systems within a limit.")
    systems = doc["systems"]
    with_ppl = bool(doc.get("perplexity"))
    cols = ["memory limit", "system", "model file"] + (["held-out PPL (vs stock)"] if with_ppl else []) + \
        ["decode tok/s (best)", "peak RSS", "disk/token"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(cols) - 3)) + "|"]
    notes: list[str] = []
    files = doc.get("stock_files") or {}
    for lim in doc["limits_bytes"]:
        for s in systems:
            e = next((e for e in doc["runs"] if e["system"] == s and e["limit_bytes"] == lim), None)
            size = (files.get(s) or {}).get("bytes") if s.startswith("stock") else doc.get("model_dir_bytes")
            row = [_limit(lim), _system_name(s, doc), _mb(size) if size else "–"] + ([_ppl_cell(doc, s)] if with_ppl else [])
            if e is None:
                row += ["–"] * 3
            elif e["status"] != "ok" or not e.get("result"):
                why = e.get("reason") or (e.get("stderr_tail") or "").strip().splitlines()[-1:] or [""]
                why = why if isinstance(why, str) else why[0]
                if why:
                    why = why[:200]
                    if why not in notes:
                        notes.append(why)
                    row += [f"{e['status']} [{notes.index(why) + 1}]", "–", "–"]
                else:
                    row += [e["status"], "–", "–"]
            else:
                r = e["result"]
                dec, best = r.get("decode_tok_s"), r.get("decode_tok_s_best")
                per_tok = r.get("disk_read_bytes_per_decode_token")
                cell = "–" if dec is None else f"{dec:.2f}" + (f" ({best:.2f})" if best is not None else "")
                row += [cell, _mb(r.get("peak_rss_bytes")), _mb(per_tok)]
            lines.append("| " + " | ".join(row) + " |")
    if notes:
        lines += [""] + [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    made = {s: f["made"] for s, f in files.items() if f.get("made") and s in systems}
    if made:
        lines += ["", "Smaller quants: " + "; ".join(f"{_system_name(s, doc)} = {how}" for s, how in made.items())
                  + ". Re-quantized from an already quantized file (the only one available here), they are "
                    "somewhat worse than the same types quantized from the original f16 weights."]
    if with_ppl:
        ppl = doc["perplexity"]
        n = next((v.get("n_scored") for v in ppl.values() if v.get("n_scored")), None)
        lines += ["", f"Held-out PPL: `leanstream perplexity` on the bundled held-out text ({n} scored tokens, "
                      f"windows of {st.get('ppl_ctx', 512)}), measured once per system without a limit: a limit "
                      f"changes where weights are read from, not what is computed"
                      + (f"; taken from the run in {src}" if (src := next((v.get('measured_in') for v in ppl.values()
                                                                            if v.get('measured_in')), None)) else "")
                      + "."]
    lines += ["", "Peak RSS is VmHWM: it also counts mapped pages of shared libraries that other processes brought "
              "into the page cache (charged to them, not to the run's cgroup), so it can exceed the limit; the "
              "charged peak the limit binds is `cgroup.max_usage_bytes` in the JSON. Disk/token = bytes read from "
              "disk per decoded token (/proc/self/io read_bytes, median over repetitions)."]
    budgets = {e["system"]: e.get("plugin_reserve_bytes") for e in doc["runs"] if e.get("plugin_reserve_bytes")}
    how = {s: v.get("how") for s, v in (st.get("plugin_reserve") or {}).items()}
    if budgets:
        lines += ["", "LeanStream runs under a limit L get memory_budget = L − reserve for their FFN weight cache "
                  "(reserve: " + "; ".join(f"{s} {_mb(b)}" + (f", {how[s]}" if how.get(s) else "")
                                          for s, b in budgets.items()) + ")."]
    match = [(e["system"], _limit(e["limit_bytes"]), e.get("greedy_match_vs_stock")) for e in doc["runs"]
             if not e["system"].startswith("stock") and e.get("greedy_match_vs_stock") is not None]
    if match:
        worst = min(match, key=lambda t: t[2])
        lines += [f"Correctness check: greedy continuations identical to stock's for "
                  f"{sum(1 for t in match if t[2] == 1.0)}/{len(match)} LeanStream runs "
                  f"(lowest match {worst[2]:.2f}: {worst[0]} at {worst[1]})."]
    return "\n".join(lines)


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:])
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    out = []
    for p in paths:
        out.append(table(json.loads(Path(p).read_text())))
    print("\n\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
