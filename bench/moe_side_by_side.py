"""A mixture-of-experts GGUF side by side under one whole-process memory limit: stock
llama-cpp-python (mmap) on the GGUF against the plugin on its converted directory, with what
bench/side_by_side.py does not measure: where the plugin's decode time and bytes go.

    python bench/moe_side_by_side.py --gguf /tmp/qwen3moe-16l.gguf --model-dir /tmp/qwen3moe-16l.lsm \
        --limit 4000MB --rounds 2 --out bench/results/moe-qwen3moe16-4000MB-2026-12-06.json

Each run is a fresh process (this script again with --child) in its own memory cgroup of exactly
the limit's bytes (leanstream_tools/cgroup.py; "ram": a cgroup that only accounts), after the
page cache of the GGUF and of every file of the model directory was dropped. Systems alternate
(stock, plugin, stock, plugin, ...: --rounds rounds). All: --threads threads, n_ctx 512, greedy.

  stock    llama_cpp.Llama(gguf), llama-cpp-python's defaults (mmap); decode = eval + argmax
  stock-mmap  the same computing on the mmapped weights, without the copies llama.cpp repacks
           for its CPU kernels (use_extra_bufts off): what stock reads from disk without them
  stock-fa the same with flash_attn=True, the attention the plugin runs by default (a check of
           where greedy continuations part, not a speed claim)
  plugin   leanstream_ggml.Llama(dir, memory_limit=LIMIT), every other option its default (in RAM:
           no limit, so it runs the source GGUF on llama.cpp, stock.py); decode through generate
           where it speculates (prompt lookup), as `leanstream bench` does
  plugin-plain  the same with speculative="off": one eval + argmax per token
  plugin-plain-noahead / -ahead / -lru / -lru-noahead  plugin-plain without read-ahead, with it
           always on, with LRU eviction instead of LFU, without either (what 4e83d52 ran)
  plugin-plain-op  plugin-plain with in_ram="stream": in RAM, the op with every expert cached

Per run, over the decode only (the prompt is evaluated, then the counters are taken / reset):
decode tok/s; the process's disk reads (/proc/self/io read_bytes, O_DIRECT included) and the
device's (/proc/diskstats sectors read of the disk holding the model); the disk's busy share
(io_ticks / wall); CPU share (process user+sys / wall / threads); major faults; and for the
plugin its counters (llm.stats(): hits, misses, bytes_read, stall and compute time) with the
routed misses' bytes (misses x expert_stride, per layer) to hold the bytes read against (a dense
model's directory, bench/dense7b.py: its counters, bytes read and cache bytes, no routing).
A run past --timeout is killed; its per-token progress (stderr) still gives a rate.

--ceiling: before the runs (and after them), the disk's rate for the reads the plugin makes:
random O_DIRECT reads of one expert (expert_stride bytes) and of 4 experts, with 8 threads, over
the expert files (bench/disk_iops.c), the faster of two kept.

Prints one JSON document (and writes it to --out). Nothing else may run meanwhile (docs/design.md §6).
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchkit
from leanstream_tools import cgroup, measure

HERE = Path(__file__).resolve().parent
PROMPT = "The history of the old harbour town begins with"
# the plugin's systems: leanstream_ggml.Llama with these options besides memory_limit
PLUGINS = {"plugin": {}, "plugin-plain": {"speculative": "off"},
           # the parts of the MoE decode apart: no read-ahead, no hot set, neither
           "plugin-plain-noahead": {"speculative": "off", "read_ahead": "off"},
           "plugin-plain-ahead": {"speculative": "off", "read_ahead": "on"},
           "plugin-plain-lru": {"speculative": "off", "expert_cache": "lru"},
           "plugin-plain-lru-noahead": {"speculative": "off", "read_ahead": "off", "expert_cache": "lru"},
           # in RAM (--limit ram): the op over every expert cached, not the source on llama.cpp
           "plugin-plain-op": {"speculative": "off", "in_ram": "stream"}}
TEXT = benchkit.REPO / "leanstream_tools" / "data" / "heldout-technical.txt"


# ---------------------------------------------------------------------------------------------
# the device and process counters

def disk_of(path: str) -> str:
    """The /proc/diskstats name of the whole disk holding ``path`` (a partition's parent)."""
    st = os.stat(path)
    sys_dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
    if (sys_dev / "partition").exists():
        sys_dev = sys_dev.parent
    return sys_dev.name


def diskstats(name: str) -> dict:
    """sectors read (bytes) and io_ticks (ms the device had I/O in flight) of disk ``name``."""
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if len(f) >= 14 and f[2] == name:
            return {"read_bytes": int(f[5]) * 512, "reads": int(f[3]), "io_ticks_ms": int(f[12])}
    raise RuntimeError(f"disk {name} not in /proc/diskstats")


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy (user, nice, system, irq, softirq, steal)."""
    f = Path("/proc/stat").read_text().splitlines()[0].split()
    return sum(int(f[i]) for i in (1, 2, 3, 6, 7, 8)) / os.sysconf("SC_CLK_TCK")


def snapshot(disk: str) -> dict:
    ru = resource.getrusage(resource.RUSAGE_SELF)   # every thread of the process
    return {"t": time.perf_counter(), "cpu_s": ru.ru_utime + ru.ru_stime, "majflt": ru.ru_majflt,
            "machine_busy_s": machine_busy_s(), "proc_read_bytes": measure.disk_read_bytes(), "disk": diskstats(disk)}


def over(a: dict, b: dict, n_threads: int) -> dict:
    wall = b["t"] - a["t"]
    cpu = b["cpu_s"] - a["cpu_s"]
    d = {k: b["disk"][k] - a["disk"][k] for k in a["disk"]}
    others = b["machine_busy_s"] - a["machine_busy_s"] - cpu
    return {"wall_s": wall, "cpu_s": cpu, "cpu_share": cpu / wall / n_threads, "major_faults": b["majflt"] - a["majflt"],
            # what the rest of the machine ran meanwhile (other processes), a share of all cores
            "others_cpu_share": max(others, 0.0) / wall / (os.cpu_count() or 1),
            "proc_read_bytes": (b["proc_read_bytes"] - a["proc_read_bytes"]) if a["proc_read_bytes"] is not None else None,
            "disk_read_bytes": d["read_bytes"], "disk_reads": d["reads"],
            "disk_busy_share": d["io_ticks_ms"] / 1e3 / wall}


# ---------------------------------------------------------------------------------------------
# the child: one system, one process

def progress(what: str, **kw) -> None:
    """A line on stderr the parent reads back when the run is killed (timeout, OOM)."""
    print("#progress " + json.dumps({"what": what, "t": time.perf_counter(), **kw}), file=sys.stderr, flush=True)


def open_llm(a: dict):
    common = dict(n_ctx=a["n_ctx"], n_threads=a["threads"], n_threads_batch=a["threads"], seed=0, verbose=False)
    if a["system"] in ("stock", "stock-fa", "stock-mmap"):
        import llama_cpp
        from llama_cpp import Llama

        if a["system"] == "stock-mmap":   # no repacked copies (llama_model_params.use_extra_bufts, which
            low = llama_cpp.llama_cpp     # llama_cpp.Llama does not take): the mmap only
            default = low.llama_model_default_params

            def params():
                p = default()
                p.use_extra_bufts = False
                return p
            low.llama_model_default_params = params
        # stock-fa: with flash attention, as the plugin sets it by default (llama.py)
        return Llama(model_path=a["gguf"], flash_attn=a["system"] == "stock-fa", **common)
    from leanstream_ggml import Llama

    extra = {"memory_limit": a["limit"]} if a["limit"] is not None else {}
    return Llama(a["model_dir"], **common, **extra, **PLUGINS[a["system"]])


def routed_miss_bytes(llm) -> tuple[int, int]:
    """(misses x expert_stride summed over layers, the largest expert_stride)."""
    total, stride_max = 0, 0
    for il in range(llm.engine.n_layer):
        stride = llm.engine.layer_info(il)["expert_stride"]
        total += llm.stats(il)["misses"] * stride
        stride_max = max(stride_max, stride)
    return total, stride_max


def child(a: dict) -> dict:
    import numpy as np

    from leanstream_ggml.llamacpp import context

    disk = disk_of(a["gguf"])
    t0 = time.perf_counter()
    progress("start")
    llm = open_llm(a)
    load_s = time.perf_counter() - t0
    plugin = a["system"] in PLUGINS
    backend = getattr(llm, "backend", "stock")
    engine = plugin and backend != "stock"
    progress("loaded", load_s=load_s)
    prompt = llm.tokenize(a["prompt"].encode(), add_bos=True)
    if a.get("decode") == "forced":   # the prompt: the text's first n_prompt tokens; then its next n_gen
        text = llm.tokenize(Path(a["text"]).read_text(encoding="utf-8").encode(), add_bos=True)
        prompt, a["forced"] = text[:a["n_prompt"]], text[a["n_prompt"]:a["n_prompt"] + a["n_gen"]]
    s0 = snapshot(disk)
    llm.eval(prompt)
    s1 = snapshot(disk)
    progress("prefilled", prefill_s=s1["t"] - s0["t"])
    prefill_stats = llm.stats() if engine else None
    if engine:
        llm.reset_stats()
    tok = int(np.argmax(context.logits(llm)))
    generated = [tok]
    speculative = getattr(llm, "speculative", "off") if plugin else "off"
    forced = a.get("decode", "greedy") == "forced"
    if forced:
        speculative = "off (forced tokens)"
    s2 = snapshot(disk)
    if forced:
        # the text's next token fed each step (one llama_decode of one token, as greedy decoding
        # runs): the routing follows real text instead of the random model's own loop
        argmax = [tok]
        for i, t in enumerate(a["forced"][:a["n_gen"]]):
            llm.eval([t])
            argmax.append(int(np.argmax(context.logits(llm))))
            progress("token", i=i + 1)
        generated = list(a["forced"][:a["n_gen"]]) + [None]   # what was fed ([:-1] below)
    elif speculative != "off":
        gen = llm.generate(prompt + [tok], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
        for t in gen:
            generated.append(int(t))
            progress("token", i=len(generated) - 1)
            if len(generated) > a["n_gen"]:
                break
        gen.close()
    else:
        for i in range(a["n_gen"]):
            llm.eval([tok])
            tok = int(np.argmax(context.logits(llm)))
            generated.append(tok)
            progress("token", i=i + 1)
    s3 = snapshot(disk)
    dec = over(s2, s3, a["threads"])
    n = a["n_gen"]
    out = {"system": a["system"], "backend": backend, "speculative": speculative, "load_s": load_s,
           "n_prompt": len(prompt), "n_gen": n, "prefill": over(s0, s1, a["threads"]), "decode": dec,
           "decode_tok_s": n / dec["wall_s"],
           "disk_read_bytes_per_token": dec["disk_read_bytes"] / n,
           "proc_read_bytes_per_token": None if dec["proc_read_bytes"] is None else dec["proc_read_bytes"] / n,
           "generated": generated[:-1], "peak_rss_bytes": measure.proc_status().get("VmHWM")}
    if forced:
        out["argmax"] = argmax   # the model's top-1 after the prompt and after each forced token
    if engine:
        out |= engine_fields(llm, prefill_stats, dec, n)
    llm.close()
    return out


def engine_fields(llm, prefill_stats: dict, dec: dict, n: int) -> dict:
    """The plugin's counters over the decode, its memory plan, and for a mixture-of-experts model
    the routed misses' bytes to hold the bytes read against."""
    st = llm.stats()
    plan = llm.memory_plan
    out = {"engine_prefill": prefill_stats, "engine_decode": st, "bytes_read_per_token": st["bytes_read"] / n,
           "memory_budget_bytes": plan.budget if plan is not None else None,
           "memory_plan": plan.to_dict() if plan is not None else None,
           "memory_plan_fitted": plan.fitted if plan is not None else None}
    if llm.manifest.moe is not None:
        miss_bytes, stride = routed_miss_bytes(llm)
        out["expert_stride"] = stride
        out["routed_miss_bytes"] = miss_bytes
        out["bytes_read_over_routed_misses"] = st["bytes_read"] / miss_bytes if miss_bytes else None
        out["proc_read_over_routed_misses"] = (dec["proc_read_bytes"] / miss_bytes
                                               if miss_bytes and dec["proc_read_bytes"] is not None else None)
        out["hit_rate"] = st["hit_ratio"]
        for k in ("ahead_recall", "ahead_precision", "ahead_wasted_bytes", "ahead_reads", "ahead_used", "pinned"):
            if k in st:   # (an older checkout's engine has no read-ahead)
                out[k] = st[k]
        # experts served without the op's own read: resident, or landed from a read-ahead
        out["served_rate"] = (st["experts"] - st["misses"]) / st["experts"] if st["experts"] else None
    return out


# ---------------------------------------------------------------------------------------------
# the disk's ceiling

def ceiling(files: list[str], stride: int, depths=(8,), seconds: float = 4.0) -> list[dict]:
    """MB/s of random O_DIRECT reads of 1 and 4 experts at each depth (threads, disk_iops.c)."""
    import disk_iops

    size1 = -(-stride // 4096) * 4096
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = disk_iops.build(Path(tmp))
        disk_iops.run_cell(exe, files, size1, 8, 64, seed=7)   # warm-up
        for size in (size1, 4 * size1):
            for depth in depths:
                cells.append(disk_iops.measure(exe, files, size, depth, seconds, seed=len(cells) * 10 + 11))
                log(f"ceiling: {size} B x {depth} threads: {cells[-1]['mb_s']} MB/s")
    return cells


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the parent

def partial_rate(stderr: str) -> dict:
    """What a killed run got done: phases reached, tokens decoded and their rate."""
    rows = [json.loads(m) for m in re.findall(r"^#progress (.*)$", stderr, re.M)]
    by = {r["what"]: r for r in rows if r["what"] != "token"}
    toks = [r for r in rows if r["what"] == "token"]
    out = {"phases": [r["what"] for r in rows if r["what"] != "token"], "tokens_decoded": len(toks)}
    if "loaded" in by:
        out["load_s"] = by["loaded"]["load_s"]
    if "prefilled" in by:
        out["prefill_s"] = by["prefilled"]["prefill_s"]
        if toks:
            out["decode_tok_s_so_far"] = len(toks) / (toks[-1]["t"] - by["prefilled"]["t"])
    return out


def one_run(a: dict, system: str, limit: int | None, files: list[str], timeout: float,
            script: str | None = None) -> dict:
    """One system at one limit in a fresh process (``script``'s child: this one's by default)."""
    measure.drop_page_cache(files)
    resident = sum(measure.resident_bytes(f) or 0 for f in files)
    load = os.getloadavg()[0]
    res, r = benchkit.run_child(script or __file__, {**a, "system": system, "limit": limit}, limit_bytes=limit,
                                timeout_s=timeout, account=True)
    row = {"system": system, "limit_bytes": limit, "status": r.status, "wall_s": round(r.wall_s, 2),
           "cgroup": r.cgroup, "page_cache_resident_at_start_bytes": resident, "loadavg_1min_at_start": load}
    if r.status == "ok":
        row["result"] = res
    else:
        row["partial"] = partial_rate(r.stderr)
        row["stderr_tail"] = "\n".join(l for l in r.stderr.splitlines() if not l.startswith("#progress"))[-1500:]
    res = row.get("result") or {}
    log(f"{system:>6} @ {limit or 'ram'}: {r.status} {res.get('decode_tok_s') or 0:.3f} tok/s "
                 f"disk {res.get('disk_read_bytes_per_token', 0) / 1e6:.1f} MB/token  busy "
                 f"{(res.get('decode') or {}).get('disk_busy_share', 0):.2f} cpu {(res.get('decode') or {}).get('cpu_share', 0):.2f} "
                 f"others {(res.get('decode') or {}).get('others_cpu_share', 0):.2f} "
                 f"hit {res.get('hit_rate')}  ({r.wall_s:.0f} s) {row.get('partial') or ''}")
    return row


def summary(rows: list[dict], ceil: list[dict]) -> dict:
    """Medians per system, the plugin's ratios to stock and to the ceiling."""
    best_ceiling = max((c["mb_s"] for c in ceil if c["size"] == min(x["size"] for x in ceil) and c["depth"] == 8),
                       default=None)
    out = {}
    for system in sorted({r["system"] for r in rows}):
        ok = [r["result"] for r in rows if r["system"] == system and r["status"] == "ok"]
        failed = [r for r in rows if r["system"] == system and r["status"] != "ok"]
        s = {"runs_ok": len(ok), "runs_failed": [{"status": r["status"], **r.get("partial", {})} for r in failed]}
        if ok:
            med = lambda f: statistics.median(f(x) for x in ok)   # noqa: E731
            s["decode_tok_s"] = [round(x["decode_tok_s"], 3) for x in ok]
            s["decode_tok_s_median"] = med(lambda x: x["decode_tok_s"])
            s["disk_read_mb_per_token"] = med(lambda x: x["disk_read_bytes_per_token"] / 1e6)
            s["disk_busy_share"] = med(lambda x: x["decode"]["disk_busy_share"])
            s["cpu_share"] = med(lambda x: x["decode"]["cpu_share"])
            s["others_cpu_share_max"] = max(x["decode"]["others_cpu_share"] for x in ok)
            s["disk_mb_s"] = med(lambda x: x["decode"]["disk_read_bytes"] / x["decode"]["wall_s"] / 1e6)
            if best_ceiling:
                s["disk_mb_s_over_ceiling"] = s["disk_mb_s"] / best_ceiling
            if all("routed_miss_bytes" in x for x in ok):    # a mixture-of-experts model's engine
                s["hit_rate"] = med(lambda x: x["hit_rate"])
                s["bytes_read_mb_per_token"] = med(lambda x: x["bytes_read_per_token"] / 1e6)
                s["bytes_read_over_routed_misses"] = med(lambda x: x["bytes_read_over_routed_misses"])
                s["proc_read_over_routed_misses"] = med(lambda x: x["proc_read_over_routed_misses"])
                s["stall_share"] = med(lambda x: x["engine_decode"]["stall_ns"] / 1e9 / x["decode"]["wall_s"])
                s["cache_slots"] = ok[0]["engine_decode"]["cache_slots"]
            elif all("engine_decode" in x for x in ok):       # a dense model's (io_stall: summed over threads)
                s["bytes_read_mb_per_token"] = med(lambda x: x["bytes_read_per_token"] / 1e6)
                s["io_stall_s_per_token"] = med(lambda x: x["engine_decode"]["io_stall_ns"] / 1e9 / x["n_gen"])
                s["cache_bytes"] = med(lambda x: x["engine_decode"]["cache_bytes"])
            if all("engine_decode" in x for x in ok):
                spec = [x["engine_decode"].get("speculative") for x in ok if x["speculative"] != "off (forced tokens)"]
                if spec and all(spec):
                    s["tokens_per_pass"] = [sp.get("tokens_per_pass") for sp in spec]
        out[system] = s
    if "stock" in out and "plugin" in out and out["stock"].get("decode_tok_s_median") and out["plugin"].get("decode_tok_s_median"):
        out["plugin_over_stock"] = out["plugin"]["decode_tok_s_median"] / out["stock"]["decode_tok_s_median"]
    # correctness: greedy continuations (where each system's own tokens were fed back: the share
    # before the first difference) or forced decoding's top-1 per step (the share that agree)
    res = {r["system"]: r["result"] for r in rows if r["status"] == "ok"}
    names = sorted(res)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            if "argmax" in res[x] and "argmax" in res[y]:
                a, b = res[x]["argmax"], res[y]["argmax"]
                out[f"top1_agreement_{y}_vs_{x}"] = sum(p == q for p, q in zip(a, b)) / max(min(len(a), len(b)), 1)
            else:
                a, b = res[x]["generated"], res[y]["generated"]
                k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
                out[f"greedy_match_{y}_vs_{x}"] = k / max(min(len(a), len(b)), 1)
    return out


def main() -> int:
    ap = benchkit.parser(__doc__, child=True)
    ap.add_argument("--gguf", help="the source GGUF (stock runs it)")
    ap.add_argument("--model-dir", help="the GGUF converted (leanstream convert)")
    ap.add_argument("--limit", default="4000MB", help='a whole-process limit ("4000MB" = 4*10^9 bytes) or "ram"')
    ap.add_argument("--systems", default="stock,plugin")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", "--n-gen", type=int, default=48)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--prompt", default=PROMPT, help="greedy decoding's prompt")
    ap.add_argument("--decode", choices=("greedy", "forced"), default="greedy",
                    help="greedy: the model's own continuation; forced: --text's tokens fed one per step "
                         "(its first --n-prompt tokens the prompt), the model's top-1 kept for the agreement")
    ap.add_argument("--text", default=str(TEXT), help="forced decoding's text")
    ap.add_argument("--n-prompt", type=int, default=16, help="forced decoding's prompt tokens")
    ap.add_argument("--timeout", type=float, default=600, help="s per run; past it the run is killed")
    ap.add_argument("--stock-timeout", type=float, default=None, help="s per stock run (default --timeout)")
    ap.add_argument("--ceiling", action="store_true", help="measure the disk's ceiling before and after")
    ap.add_argument("--ceiling-only", default=None, metavar="DEPTHS",
                    help="only the disk's ceiling at these depths (e.g. 1,2,4,8), no runs")
    ap.add_argument("--probe", default=None, help="bench/routing_probe.py's JSON of the GGUF: its routing, printed beside the speeds")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.child:
        return benchkit.answer_child(a.child, child)
    if not a.gguf or not a.model_dir:
        ap.error("--gguf and --model-dir are required")
    from leanstream_ggml.model import manifest as mf

    model_dir = Path(a.model_dir)
    m = mf.load(model_dir)
    expert_files = [str(m.resolve(model_dir, e.file)) for e in m.moe.layers]
    stride = max(e.expert_stride for e in m.moe.layers)
    files = [a.gguf] + [str(f) for f in measure.model_files(model_dir)]
    limit = benchkit.regime_limit(a.limit)
    if a.ceiling_only:
        depths = [int(x) for x in a.ceiling_only.split(",")]
        return benchkit.emit({"benchmark": "moe_side_by_side --ceiling-only", "model_dir": model_dir.name,
                              "expert_stride": stride, "cells": ceiling(expert_files, stride, depths, 3.0),
                              "machine": measure.machine_info()}, a.out)
    ok, where = cgroup.availability()
    if not ok:
        raise SystemExit(f"cgroups not writable ({where}): this bench needs real limits")
    spec = {"gguf": str(Path(a.gguf).resolve()), "model_dir": str(model_dir.resolve()), "n_gen": a.n_gen,
            "threads": a.threads, "n_ctx": 512, "prompt": a.prompt,
            "decode": a.decode, "text": str(Path(a.text).resolve()), "n_prompt": a.n_prompt}
    ceil_before = ceiling(expert_files, stride) if a.ceiling else []
    rows = []
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    for rnd in range(a.rounds):
        for system in systems:
            timeout = a.stock_timeout if system.startswith("stock") and a.stock_timeout else a.timeout
            rows.append(one_run(spec, system, limit, files, timeout) | {"round": rnd})
    ceil_after = ceiling(expert_files, stride) if a.ceiling else []
    ceil = ceil_before + ceil_after
    doc = {"benchmark": "moe_side_by_side", "gguf": Path(a.gguf).name, "model_dir": model_dir.name,
           "gguf_bytes": os.path.getsize(a.gguf), "expert_bytes": measure.files_size(expert_files),
           "expert_stride": stride, "n_expert": m.moe.n_expert, "n_expert_used": m.moe.n_expert_used,
           "n_layer": m.n_layer, "limit": a.limit, "limit_bytes": limit,
           "settings": {"systems": systems, "rounds": a.rounds, "n_gen": a.n_gen, "decode": a.decode,
                        "n_prompt_forced": a.n_prompt if a.decode == "forced" else None,
                        "text": Path(a.text).name if a.decode == "forced" else None, "threads": a.threads, "n_ctx": 512,
                        "prompt": a.prompt, "timeout_s": a.timeout, "stock_timeout_s": a.stock_timeout or a.timeout,
                        "page_cache_dropped": True, "disk": disk_of(a.gguf)},
           "routing": _routing(a.probe),
           "disk_ceiling": {"depth": 8, "cells_before": ceil_before, "cells_after": ceil_after},
           "machine": measure.machine_info(), "stock": _stock_description(),
           "summary": summary(rows, ceil), "runs": rows}
    return benchkit.emit(doc, a.out)


def _routing(probe: str | None) -> dict:
    """How the model routes, beside its speed: bench/routing_probe.py's summary (--probe), with a
    real model's published figures."""
    if not probe:
        return {"measured": None, "note": "not given: run bench/routing_probe.py on the GGUF (--probe FILE)"}
    d = json.loads(Path(probe).read_text())
    keep = ("tokens", "text", "distinct", "lag1_reuse", "top8_share", "next_layer_recall", "published")
    return {"measured": {k: d[k] for k in keep if k in d}, "probe": Path(probe).name}


def _stock_description() -> str:
    from leanstream_tools import systems

    return systems.stock_description()


if __name__ == "__main__":
    sys.exit(main())
