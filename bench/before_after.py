"""The same measurements on two checkouts of the project, interleaved: did a change that should
not move speed or memory move them?

    git worktree add /tmp/before <rev>      # its native library built against this llama.cpp:
    PYTHONPATH=/tmp/before python -c "from leanstream_ggml import build; build.build_native(build.installed_llama_lib_dir())"
    python bench/before_after.py --before /tmp/before --model smollm2-135m-instruct --rounds 3 \\
        --out bench/results/before-after-<what>-<date>.json

Each round runs, for the "before" checkout and then this one (each in a fresh process whose
PYTHONPATH is that checkout, so its leanstream_ggml, native library and tools are the ones used):
`leanstream bench MODEL_DIR --json` in RAM with the op (``--in-ram stream``) and under a budget
that streams most of the FFN (``--memory-budget``), plain decoding (``--speculative off``) and the
default; and `leanstream convert` of the model's GGUF into a fresh directory (seconds and peak
memory by stage, from the manifest). The model directory the benches read is converted once, by
this checkout (the directory format did not change). Prints one JSON document: every run, and per
configuration the after/before ratio of the medians (decode and prefill tok/s, peak RSS).
Run it on a quiet machine: the two checkouts share it turn by turn.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchkit

CONFIGS = {   # name -> `leanstream bench` flags
    "ram-off": ["--in-ram", "stream", "--speculative", "off"],
    "ram-default": ["--in-ram", "stream"],
    "budget-off": ["--memory-budget", "16MiB", "--speculative", "off"],
    "budget-default": ["--memory-budget", "16MiB"],
}


def _run(tree: Path, args: list[str], timeout: float = 900) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=tree)
    if r.returncode != 0:
        return {"error": r.stderr[-2000:], "seconds": time.perf_counter() - t0}
    return {"out": r.stdout, "seconds": time.perf_counter() - t0}


def bench(tree: Path, model_dir: Path, flags: list[str], n_gen: int) -> dict:
    r = _run(tree, ["-m", "leanstream_tools.cli", "bench", str(model_dir), "--json", "-p", "128", "-n", str(n_gen),
                    "-r", "3", "-t", "2", *flags])
    if "error" in r:
        return r
    return json.loads(r["out"].strip().splitlines()[-1])


def convert(tree: Path, gguf: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    r = _run(tree, ["-m", "leanstream_ggml.cli", "convert", str(gguf), str(out), "--quiet"], timeout=1800)
    if "error" in r:
        return r
    m = json.loads((out / "manifest.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": r["seconds"], "conversion": m.get("conversion", {})}


def _median(rows: list[dict], *keys) -> float | None:
    vals = []
    for r in rows:
        v = r
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        if isinstance(v, (int, float)):
            vals.append(float(v))
    return statistics.median(vals) if vals else None


def summary(runs: list[dict]) -> dict:
    out = {}
    for name in [*CONFIGS, "convert"]:
        rows = {side: [r[name] for r in runs if r["side"] == side and name in r] for side in ("before", "after")}
        keys = ([("seconds",), ("conversion", "peak_rss_bytes")] if name == "convert" else
                [("decode_tok_s",), ("prefill_tok_s",), ("peak_rss_bytes",)])
        out[name] = {}
        for k in keys:
            b, a = _median(rows["before"], *k), _median(rows["after"], *k)
            out[name][".".join(k)] = {"before": b, "after": a, "after/before": round(a / b, 3) if a and b else None}
    return out


def main() -> int:
    ap = benchkit.parser(__doc__)
    ap.add_argument("--before", required=True, help="the other checkout (its native library built)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a recipe name or a GGUF")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--no-convert", action="store_true", help="leave the conversion out")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from leanstream_ggml.model import registry

    gguf = registry.resolve(args.model) if not Path(args.model).is_file() else Path(args.model)
    work = Path(tempfile.mkdtemp(prefix="before-after-"))
    model_dir = work / "model.lsm"
    trees = {"before": Path(args.before).resolve(), "after": benchkit.REPO}
    r = _run(trees["after"], ["-m", "leanstream_ggml.cli", "convert", str(gguf), str(model_dir), "--quiet"], timeout=1800)
    if "error" in r:
        print(r["error"], file=sys.stderr)
        return 1
    runs = []
    for rnd in range(args.rounds):
        for side, tree in trees.items():
            row = {"round": rnd, "side": side}
            for name, flags in CONFIGS.items():
                row[name] = bench(tree, model_dir, flags, args.n_gen)
            if not args.no_convert:
                row["convert"] = convert(tree, gguf, work / f"convert-{side}.lsm")
            runs.append(row)
            print(json.dumps({"round": rnd, "side": side,
                              **{k: v.get("decode_tok_s") for k, v in row.items() if isinstance(v, dict)}}),
                  file=sys.stderr, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    doc = {"model": str(gguf), "before": str(trees["before"]), "rounds": args.rounds, "configs": CONFIGS,
           "cpu": Path("/proc/cpuinfo").read_text().split("model name")[1].split("\n")[0].strip(": "),
           "summary": summary(runs), "runs": runs}
    return benchkit.emit(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
