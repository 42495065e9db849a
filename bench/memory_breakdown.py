"""Where a LeanStream process's memory goes: anonymous and file-backed RSS, and the page cache of
each model file, at each stage of a run (imports, model open, prefill, decode), next to what the
FFN engine says it holds (cache_bytes, resident_bytes). The page cache of a file the process read
is charged to its memory cgroup, so it counts against a memory limit like anonymous memory does.

    .venv/bin/python bench/memory_breakdown.py MODEL.lsm --mode leanstream -c 512 -b 512 > out.json

Run it with the model's files cold (the script drops their page cache first, unless --warm).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import benchkit


def smaps_rollup() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        k, _, v = line.partition(":")
        parts = v.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[k.strip()] = int(parts[0]) * 1024
    return out


def snapshot(stage: str, files: dict[str, list[Path]], llm=None) -> dict:
    from leanstream_tools import measure

    r = smaps_rollup()
    st = measure.parse_proc_status(Path("/proc/self/status").read_text())
    doc = {"stage": stage, "rss": r.get("Rss"), "anonymous": r.get("Anonymous"),
           "file_rss": (r.get("Rss") or 0) - (r.get("Anonymous") or 0), "vm_hwm": st.get("VmHWM"),
           "page_cache": {}}
    for name, paths in files.items():
        got = [measure.resident_bytes(p) for p in paths]
        doc["page_cache"][name] = None if any(g is None for g in got) else sum(got)
    if llm is not None and getattr(llm, "engine", None) is not None:
        t = llm.stats()
        doc["engine"] = {k: t.get(k) for k in ("cache_bytes", "resident_bytes", "memory_budget")}
    return doc


def main(argv=None) -> int:
    ap = benchkit.parser(__doc__)
    ap.add_argument("model", help="a model directory")
    benchkit.flags(ap, "mode", "memory_budget")
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("-b", "--batch-size", type=int, default=512, help="n_batch = n_ubatch")
    ap.add_argument("-p", "--n-prompt", type=int, default=64)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--warm", action="store_true", help="do not drop the model files' page cache first")
    args = ap.parse_args(argv)

    from leanstream_ggml import Llama
    from leanstream_ggml.model import manifest as manifest_mod
    from leanstream_tools import measure

    d = Path(args.model)
    m = manifest_mod.load(d)
    files = {"base.gguf": [m.resolve(d, m.base.file)],
             "block files": [m.resolve(d, e.file) for e in m.layers],
             "sketch": [m.resolve(d, f) for f in m.sketch_files()],
             "predictors": [m.resolve(d, f) for f in m.predictor_files()]}
    files = {k: v for k, v in files.items() if v}
    if not args.warm:
        measure.drop_page_cache([p for ps in files.values() for p in ps])
    stages = [snapshot("imports", files)]
    t0 = time.perf_counter()
    llm = Llama(str(d), mode=args.mode, memory_budget=args.memory_budget, n_ctx=args.ctx_size,
                n_batch=args.batch_size, n_ubatch=args.batch_size, n_threads=args.threads, verbose=False)
    load_s = time.perf_counter() - t0
    stages.append(snapshot("open", files, llm))
    text = (Path(__file__).resolve().parent.parent / "tests" / "data" / "prose.txt").read_text()
    toks = llm.tokenize(text.encode())[: args.n_prompt]
    llm.eval(toks)
    stages.append(snapshot(f"prefill {len(toks)}", files, llm))
    for _ in range(args.n_gen):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    stages.append(snapshot(f"decode {args.n_gen}", files, llm))
    llm.close()
    print(json.dumps({"model": str(d), "mode": llm.mode, "memory_budget": args.memory_budget,
                      "n_ctx": args.ctx_size, "n_batch": args.batch_size, "load_s": load_s,
                      "file_bytes": {k: sum(p.stat().st_size for p in v) for k, v in files.items()},
                      "stages": stages, "machine": measure.machine_info()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
