"""A Llama-2-7B-shaped dense GGUF, written one chunk at a time, then converted and decoded under
whole-process memory limits: stock llama-cpp-python against the plugin, plain and speculative.

    python bench/dense7b.py write /data/llama7b-synth.gguf                       # 32 layers, ~4.4 GB
    python bench/dense7b.py convert /data/llama7b-synth.gguf /data/llama7b-synth.lsm --limit 3e9 \\
        --out bench/results/dense7b-convert-3000MB-DATE.json
    python bench/dense7b.py decode /data/llama7b-synth.gguf /data/llama7b-synth.lsm \\
        --limits 3e9,2e9 --tokens 32 --rounds 2 --out bench/results/dense7b-decode-DATE.json
    python bench/dense7b.py write /tmp/d7-2l.gguf --layers 2                     # a smoke run (~0.6 GB)

The GGUF is the benchmark's own (never committed); delete it and the model directory afterwards.

write: Llama-2-7B's shape ("llama": n_embd 4096, n_ff 11008, 32 heads and 32 key/value heads of
128, rope base 1e4, RMS eps 1e-5, context 4096) in a Q4_K_M layout: ffn_gate/ffn_up Q4_K, ffn_down
Q6_K, attention q/k/output Q4_K and v Q6_K, token_embd Q4_K, output Q6_K, the norms F32 (ones);
the tokenizer of SmolLM2-135M-Instruct (49152 tokens, leanstream_ggml.model.registry.fetch) instead of
Llama's 32000, so token_embd and output are [4096, 49152]. The weights are bench/moe_synth.py's:
random K-quant blocks whose f16 scales give values of standard deviation ~0.02, each matrix from
its own random stream, deterministic per --seed. Written by moe_synth.Writer (header first, then
each tensor's bytes in chunks of 4096 rows: < 100 MB at a time) under a temporary name, renamed;
then gguf-py's reader checks every tensor's place, type, shape and size and the header's shape.
--decode also loads it in stock llama-cpp-python and decodes 4 tokens (moe_synth.decode).

convert: `leanstream convert GGUF OUT_DIR --memory-limit LIMIT --force [--convert-arg ...]` in a
memory cgroup of exactly LIMIT's bytes, the GGUF's page cache dropped first: bench/moe_full.py's
run_convert (wall time, the cgroup's peak, the child tree's sampled RSS, disk bytes, CPU). The
per-stage seconds and peak RSS are the converter's own records (leanstream_convert/budget.py StageMeter):
the manifest's "conversion" section when the conversion finished, OUT_DIR/.convert/stages.json
when it did not; the stage lines it prints on stderr ("write: 30.2 s, peak 439 MiB resident")
are parsed too, and kept beside them.

decode: for each round, for each limit, each system (--systems, default stock, plugin-plain,
plugin) in a fresh process in a memory cgroup of exactly that many bytes, the page cache of the
GGUF and of the model directory dropped first (bench/moe_side_by_side.py one_run and child):
greedy decoding of the same prompt, n_ctx --n-ctx (512), --threads threads. stock: llama_cpp.Llama on the
GGUF (its CPU_REPACK copy of the Q4_K weights does not fit 3 GB: an OOM kill is recorded as
status "oom"); plugin-plain: leanstream_ggml.Llama(dir, memory_limit=LIMIT, speculative="off");
plugin: the same with every option its default (speculative auto, where the plan leaves room).
A limit the plugin's plan cannot hold the model in is a run of status "error" whose brief
gives the MemoryPlanError's line (what it needs). At 2e9 this shape is at the edge: base.gguf's
attention and output weights (~1.5 GB), the KV cache of n_ctx 512 (256 MiB) and the rest leave
about one layer's FFN (~88 MB) or less (estimated from the 2-layer file's plan); -c 256 frees 128 MiB.
Per run: decode tok/s, peak RSS (VmHWM) and the cgroup's peak, disk bytes per token (the
process's and the device's), the engine's bytes read per token, and the memory plan the plugin
used (Llama.memory_plan: its parts, budget, what it fitted) against what was measured
("plan_vs_measured"). The document is rewritten (--out) after every run, so a run cut short
leaves the earlier ones; printed at the end.

Timing discipline (2 shared cores): every timed step (the conversion, each decode run) waits
until --lock (default /tmp/quiet.lock) does not exist, creates it and removes it when the step
ends (moe_full.quiet; --quiet-cpu / --quiet-wait as moe_full's). Writing takes no lock.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

import benchkit
import moe_full
import moe_side_by_side as msbs
import moe_synth
from leanstream_tools import cgroup, measure

N_LAYER, N_EMBD, N_FF, N_HEAD, N_HEAD_KV, HEAD_DIM = 32, 4096, 11008, 32, 32, 128
N_CTX_TRAIN, ROPE_BASE, RMS_EPS = 4096, 1e4, 1e-5
# the Q4_K_M layout of Llama-2-7B's GGUFs, by tensor (every ffn_down and attn_v in Q6_K)
TYPES = {"ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K",
         "attn_v": "Q6_K", "attn_output": "Q4_K", "token_embd": "Q4_K", "output": "Q6_K"}
SYSTEMS = "stock,plugin-plain,plugin"
TAG = "dense7b"                                      # written in the quiet lock while a step holds it


# ---------------------------------------------------------------------------------------------
# write

def write_model(path: Path, n_layer: int, tokenizer: Path, seed: int = 0) -> tuple[dict, list]:
    """The GGUF at ``path`` (written as path + ".partial", then renamed): (its shape as a dict,
    [(tensor name, type, numpy shape)] in file order)."""
    tmp = path.with_name(path.name + ".partial")
    W = moe_synth.Writer(tmp, "llama")
    w = W.w
    w.add_type("model")
    w.add_name(f"llama-2-7b-shaped-{n_layer}l-synthetic")
    w.add_file_type(15)                                   # LLAMA_FTYPE_MOSTLY_Q4_K_M
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    n_vocab = moe_synth.copy_tokenizer(w, tokenizer)
    layout: list[tuple[str, str, tuple[int, ...]]] = []
    sub = iter(range(1, 1 << 30))                         # each matrix's random stream: [seed, sub]

    def matrix(name: str, key: str, rows: int, cols: int) -> None:
        W.tensor(name, TYPES[key], (rows, cols), moe_synth.matrix_chunks(W, seed, next(sub), TYPES[key], rows, cols))
        layout.append((name, TYPES[key], (rows, cols)))

    def norm(name: str) -> None:
        W.tensor(name, "F32", (N_EMBD,), moe_synth.const_chunks(np.ones(N_EMBD, np.float32)))
        layout.append((name, "F32", (N_EMBD,)))

    q = N_HEAD * HEAD_DIM
    kv = N_HEAD_KV * HEAD_DIM
    matrix("token_embd.weight", "token_embd", n_vocab, N_EMBD)
    for il in range(n_layer):
        p = f"blk.{il}."
        norm(p + "attn_norm.weight")
        for name, rows, cols in (("attn_q", q, N_EMBD), ("attn_k", kv, N_EMBD), ("attn_v", kv, N_EMBD),
                                 ("attn_output", N_EMBD, q)):
            matrix(p + name + ".weight", name, rows, cols)
        norm(p + "ffn_norm.weight")
        for name, rows, cols in (("ffn_gate", N_FF, N_EMBD), ("ffn_up", N_FF, N_EMBD), ("ffn_down", N_EMBD, N_FF)):
            matrix(p + name + ".weight", name, rows, cols)
    norm("output_norm.weight")
    matrix("output.weight", "output", n_vocab, N_EMBD)
    W.write()
    os.replace(tmp, path)
    shape = {"arch": "llama", "n_layer": n_layer, "n_embd": N_EMBD, "n_ff": N_FF, "n_head": N_HEAD,
             "n_head_kv": N_HEAD_KV, "head_dim": HEAD_DIM, "n_ctx_train": N_CTX_TRAIN, "rope_freq_base": ROPE_BASE,
             "rms_eps": RMS_EPS, "n_vocab": n_vocab, "types": TYPES, "tensors": len(W.plan),
             "tensor_bytes": sum(nbytes for _, _, nbytes, _ in W.plan)}
    return shape, layout


def expected_bytes(n_layer: int, n_vocab: int = 49152) -> int:
    """About what the file takes (the tensor data; the header is a few MB)."""
    q4k, q6k = 144 / 256, 210 / 256
    attn = N_EMBD * N_HEAD * HEAD_DIM * 2 * q4k + N_EMBD * N_HEAD_KV * HEAD_DIM * (q4k + q6k)
    layer = attn + N_EMBD * N_FF * (2 * q4k + q6k) + 2 * 4 * N_EMBD
    return int(n_layer * layer + n_vocab * N_EMBD * (q4k + q6k))


def check_layout(path: Path, shape: dict, layout: list) -> None:
    """gguf-py reads it back (moe_synth.read_layout: every tensor after the previous one, inside
    the file); each tensor's name, type, shape and bytes as written, and the header's shape."""
    import gguf

    r, t = moe_synth.read_layout(path, shape["tensors"])
    assert [x.name for x in r.tensors] == [name for name, _, _ in layout]
    for name, type_name, shp in layout:
        x = t[name]
        qt = gguf.GGMLQuantizationType[type_name]
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        assert x.tensor_type == qt, (name, x.tensor_type.name, type_name)
        assert [int(v) for v in x.shape] == list(reversed(shp)), (name, list(x.shape), shp)   # ggml order
        assert x.n_bytes == math.prod(shp) // bs * ts, (name, x.n_bytes)
    for key, want in (("llama.block_count", shape["n_layer"]), ("llama.embedding_length", N_EMBD),
                      ("llama.feed_forward_length", N_FF), ("llama.attention.head_count", N_HEAD),
                      ("llama.attention.head_count_kv", N_HEAD_KV), ("llama.context_length", N_CTX_TRAIN)):
        assert r.get_field(key).contents() == want, (key, r.get_field(key).contents(), want)
    assert len(r.get_field("tokenizer.ggml.tokens").data) == shape["n_vocab"]


def cmd_write(a) -> int:
    tokenizer = moe_synth.room_and_tokenizer(a.path, expected_bytes(a.layers), a.tokenizer)
    if tokenizer is None:
        return 1
    t0 = time.perf_counter()
    shape, layout = write_model(a.path, a.layers, tokenizer, a.seed)
    seconds = time.perf_counter() - t0
    check_layout(a.path, shape, layout)
    doc = {"benchmark": "dense7b write", "path": str(a.path), "bytes": a.path.stat().st_size,
           "seconds": round(seconds, 1), "seed": a.seed, "tokenizer": Path(tokenizer).name, **shape}
    if a.decode:
        doc["decode"] = moe_synth.decode(a.path)
    return benchkit.emit(doc, a.out)


# ---------------------------------------------------------------------------------------------
# convert

def limit_arg(text: str) -> str:
    """A limit as its bytes in digits: "3e9", "3000MB", "3000000000" -> "3000000000" (what
    benchkit.regime_limit and `leanstream convert --memory-limit` both read)."""
    try:
        f = float(text)
    except ValueError:
        n = benchkit.regime_limit(text.strip())
        if n is None:
            raise SystemExit(f"{text!r}: a limit in bytes is needed (3e9, 3000MB)") from None
        return str(n)
    if not math.isfinite(f) or f <= 0 or f != int(f):
        raise SystemExit(f"{text!r}: not a whole positive number of bytes")
    return str(int(f))


# "write: 30.2 s, peak 439 MiB resident" (leanstream_convert/budget.py StageMeter.stage)
STAGE_LINE = re.compile(r"^(\w+): ([0-9.]+) s, peak ([0-9]+) MiB resident$")


def stage_lines(stderr: str) -> dict:
    """The converter's stage lines on stderr: {stage: {"seconds", "peak_rss_mib"}}; a progress
    bar's carriage returns before a line are skipped."""
    out = {}
    for line in stderr.splitlines():
        m = STAGE_LINE.match(line.rsplit("\r", 1)[-1].strip())
        if m:
            out[m.group(1)] = {"seconds": float(m.group(2)), "peak_rss_mib": int(m.group(3))}
    return out


def cmd_convert(a) -> int:
    a.limit_given, a.limit = a.limit, limit_arg(a.limit)
    doc, r = moe_full.run_convert(a, benchmark="dense7b convert", extra=tuple(a.convert_arg), tag=TAG)
    lines = stage_lines(r.stderr)
    records, source = None, None
    if doc.get("converter_stages"):
        records, source = doc["converter_stages"].get("stages"), "manifest.json extra.conversion"
    else:   # unfinished: the meter's records of the stages that finished
        try:
            records = json.loads((Path(a.model_dir) / ".convert" / "stages.json").read_text())
            source = ".convert/stages.json (unfinished conversion)"
        except (OSError, ValueError):
            pass
    if not records and lines:
        records = {k: {"seconds": v["seconds"], "peak_rss_bytes": v["peak_rss_mib"] * 2**20} for k, v in lines.items()}
        source = "stderr stage lines"
    doc["limit_given"] = a.limit_given
    doc["stage_seconds"] = {k: v["seconds"] for k, v in (records or {}).items()}
    doc["stage_peak_rss_bytes"] = {k: v["peak_rss_bytes"] for k, v in (records or {}).items()}
    doc["stage_source"] = source
    doc["stderr_stage_lines"] = lines
    doc["peak_bytes"] = {"cgroup": doc["cgroup_peak_bytes"], "rss_sampled": doc["peak_rss_sampled_bytes"],
                         "converter_vmhwm": max(doc["stage_peak_rss_bytes"].values(), default=None)}
    moe_full.log("stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in doc["stage_seconds"].items()))
    return benchkit.emit(doc, a.out)


# ---------------------------------------------------------------------------------------------
# decode

def plan_vs_measured(row: dict) -> dict | None:
    """The plugin's memory plan against its run: the plan's parts (margin apart) plus the engine's
    resident part and the FFN cache it filled, the bytes it predicts the process holds, against the
    process's peak RSS and the cgroup's charged peak (page cache included)."""
    res = row.get("result") or {}
    plan = res.get("memory_plan")
    if not plan:
        return None
    parts = {k: v for k, v in plan.items() if k not in ("limit", "budget", "resident")}
    cache = (res.get("engine_decode") or {}).get("cache_bytes")
    predicted = sum(v for k, v in parts.items() if k != "margin") + plan["resident"] + (cache or 0)
    rss, cg = res.get("peak_rss_bytes"), (row.get("cgroup") or {}).get("max_usage_bytes")
    return {"plan_limit_bytes": plan["limit"], "plan_reserve_bytes": sum(parts.values()),
            "plan_budget_bytes": plan["budget"], "plan_resident_bytes": plan["resident"],
            "plan_cache_bytes": plan["budget"] - plan["resident"], "engine_cache_bytes": cache,
            "predicted_peak_bytes": predicted, "peak_rss_bytes": rss, "cgroup_peak_bytes": cg,
            "rss_over_predicted": round(rss / predicted, 3) if rss and predicted else None,
            "cgroup_peak_over_limit": round(cg / plan["limit"], 3) if cg else None,
            "fitted": res.get("memory_plan_fitted")}


def brief(row: dict) -> dict:
    """A run's numbers in one line of the summary."""
    res = row.get("result") or {}
    out = {"round": row["round"], "limit": row["limit"], "system": row["system"], "status": row["status"]}
    if row["status"] != "ok":   # the exception's line (a MemoryPlanError: what the plan needs), if any
        err = re.findall(r"^[\w.]*(?:Error|Exception)\b.*$", row.get("stderr_tail") or "", re.M)
        return out | {"partial": row.get("partial"), "error": err[-1][:300] if err else None}
    pvm = row.get("plan_vs_measured") or {}
    return out | {"backend": res.get("backend"), "speculative": res.get("speculative"),
                  "decode_tok_s": round(res["decode_tok_s"], 3), "peak_rss_bytes": res.get("peak_rss_bytes"),
                  "cgroup_peak_bytes": row["cgroup"].get("max_usage_bytes"),
                  "disk_read_bytes_per_token": round(res["disk_read_bytes_per_token"]),
                  "engine_bytes_read_per_token": (round(res["bytes_read_per_token"])
                                                  if res.get("bytes_read_per_token") is not None else None),
                  "predicted_peak_bytes": pvm.get("predicted_peak_bytes")}


def cmd_decode(a) -> int:
    from leanstream_ggml.model import manifest as mf

    model_dir = Path(a.model_dir)
    m = mf.load(model_dir)
    if m.moe is not None:
        raise SystemExit(f"{model_dir}: a mixture-of-experts model; this bench is for dense ones (moe_full.py)")
    limits = [limit_arg(x) for x in a.limits.split(",") if x.strip()]
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    for s in systems:
        if s not in ("stock", "stock-fa", *msbs.PLUGINS):
            raise SystemExit(f"unknown system {s!r}: stock, stock-fa, {', '.join(msbs.PLUGINS)}")
    ok, where = cgroup.availability()
    if not ok:
        raise SystemExit(f"cgroups not writable ({where}): this bench needs real limits")
    files = [a.gguf] + [str(f) for f in measure.model_files(model_dir)]
    spec = {"gguf": str(Path(a.gguf).resolve()), "model_dir": str(model_dir.resolve()), "n_gen": a.tokens,
            "threads": a.threads, "n_ctx": a.n_ctx, "prompt": a.prompt, "decode": "greedy",
            "text": str(msbs.TEXT), "n_prompt": 16}
    rows: list[dict] = []

    def document() -> dict:
        return {"benchmark": "dense7b decode (bench/moe_side_by_side.py runs)", "gguf": Path(a.gguf).name,
                "gguf_bytes": os.path.getsize(a.gguf), "model_dir": model_dir.name,
                "model_dir_bytes": measure.files_size(measure.model_files(model_dir)), "n_layer": m.n_layer,
                "limits": limits,
                "settings": {"systems": systems, "rounds": a.rounds, "n_gen": a.tokens, "decode": "greedy",
                             "threads": a.threads, "n_ctx": a.n_ctx, "prompt": a.prompt, "timeout_s": a.timeout,
                             "stock_timeout_s": a.stock_timeout, "page_cache_dropped": True,
                             "disk": msbs.disk_of(a.gguf), "quiet_lock": a.lock,
                             "order": "rounds, then limits, then systems"},
                "weights": "synthetic: random K-quant blocks (bench/dense7b.py write); speeds and bytes, not text",
                "machine": measure.machine_info(), "stock": msbs._stock_description(),
                "summary": {lim: msbs.summary([r for r in rows if r["limit"] == lim], []) for lim in limits},
                "brief": [brief(r) for r in rows], "runs": rows}

    for rnd in range(a.rounds):
        for lim in limits:
            for system in systems:
                timeout = a.stock_timeout if system.startswith("stock") else a.timeout
                with moe_full.quiet(a.lock, TAG) as waited:
                    stat0 = moe_full.stat_fields()
                    row = msbs.one_run(spec, system, int(lim), files, timeout)
                row |= waited
                stat = moe_full.stat_delta(stat0, moe_full.stat_fields())
                row |= {"round": rnd, "limit": lim, "stat_breakdown": stat}
                row["plan_vs_measured"] = plan_vs_measured(row)
                rows.append(row)
                if a.out:
                    Path(a.out).write_text(json.dumps(document(), indent=1) + "\n")
    return benchkit.emit(document(), a.out)


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = benchkit.parser(__doc__)
    sub = ap.add_subparsers(dest="what", required=True)
    w = sub.add_parser("write", help="write the GGUF")
    w.add_argument("path", type=Path, help="the GGUF to write")
    w.add_argument("--layers", type=int, default=N_LAYER, help="32 (Llama-2-7B's depth, ~4.4 GB); 2 for a smoke run")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--tokenizer", type=Path, default=None,
                   help="the GGUF whose tokenizer to copy (default: SmolLM2-135M-Instruct, fetched once)")
    w.add_argument("--decode", action="store_true",
                   help="also load it in stock llama-cpp-python and decode 4 tokens (no memory limit)")
    c = sub.add_parser("convert", help="convert it in a memory cgroup of --limit bytes")
    c.add_argument("gguf")
    c.add_argument("model_dir", metavar="OUT_DIR")
    c.add_argument("--limit", required=True, help="bytes: the cgroup's limit and --memory-limit (3e9, 3000MB)")
    c.add_argument("--convert-arg", action="append", default=[], metavar="ARG",
                   help="one more argument to `leanstream convert` (repeat: --convert-arg=--sketch --convert-arg=none)")
    c.add_argument("--timeout", type=float, default=3600, help="s; past it the conversion is killed")
    d = sub.add_parser("decode", help="stock and the plugin decoding under each limit")
    d.add_argument("gguf")
    d.add_argument("model_dir", metavar="MODEL_DIR")
    d.add_argument("--limits", default="3e9,2e9", help="whole-process limits in bytes, comma-separated")
    d.add_argument("--systems", default=SYSTEMS, help=f"comma-separated, in run order (default {SYSTEMS})")
    d.add_argument("--tokens", type=int, default=32, help="tokens decoded per run (greedy)")
    d.add_argument("--rounds", type=int, default=2)
    d.add_argument("-t", "--threads", type=int, default=2)
    d.add_argument("-c", "--n-ctx", type=int, default=512,
                   help="every system's n_ctx (the plugin's plan holds its KV cache: 256 MiB at 512 for this shape)")
    d.add_argument("--prompt", default=msbs.PROMPT)
    d.add_argument("--timeout", type=float, default=900, help="s per plugin run; past it the run is killed")
    d.add_argument("--stock-timeout", type=float, default=600, help="s per stock run")
    for p in (w, c, d):
        p.add_argument("--out", default=None, help="write the JSON document here too")
    for p in (c, d):
        p.add_argument("--lock", default=moe_full.LOCK)
        p.add_argument("--quiet-cpu", type=float, default=None,
                       help="run a step only while the machine's busy share (2 s, all cores) is below this")
        p.add_argument("--quiet-wait", type=float, default=600, help="s to wait for --quiet-cpu, then run anyway")
    a = ap.parse_args(argv)
    if a.what == "write":
        return cmd_write(a)
    moe_full.QUIET.update(max_busy=a.quiet_cpu, max_wait_s=a.quiet_wait)
    return cmd_convert(a) if a.what == "convert" else cmd_decode(a)


if __name__ == "__main__":
    sys.exit(main())
