"""Decode and prefill speed of llama.cpp's CPU backend variants, interleaved, for stock llama.cpp and
the plugin's dense mode.

The build carries one CPU module per instruction set (leanstream_ggml/build.py CPU_VARIANTS) and
libggml loads the best for the CPU; ``LEANSTREAM_GGML_CPU=<variant>`` loads another. The haswell
module is the AVX2-only build the project had before (same flags: identical logits, checked when
the build changed), so "default vs haswell" is "this build vs the AVX2-only one" on this host.
``--python LABEL=PATH`` adds another installation's interpreter (e.g. a checkout of the old
build) as one more setup, run the same way.

Each round runs every setup once, in turn, each in a fresh ``leanstream bench --json`` process (so
every variant is chosen at its first backend load); medians over rounds, and each setup's ratio
to haswell per system. Run it on a quiet machine.

    .venv/bin/python bench/cpu_variants.py --gguf MODEL.gguf --dir MODEL.lsm -r 5 > out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def bench_once(python: str, model: str, env_extra: dict, args) -> dict:
    cmd = [python, "-m", "leanstream_ggml.cli", "bench", model, "--json", "-p", str(args.n_prompt),
           "-n", str(args.n_gen), "-r", "1", "-t", str(args.threads)]
    env = {**os.environ, **env_extra}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO if python == sys.executable else None,
                       timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    return {"decode_tok_s": doc["decode_tok_s"], "prefill_tok_s": doc["prefill_tok_s"],
            "ggml_cpu": doc["machine"].get("ggml_cpu")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", help="a GGUF: stock llama.cpp")
    ap.add_argument("--dir", help="a model directory: the plugin, dense mode, no budget")
    ap.add_argument("--variants", default="default,haswell",
                    help="comma-separated: 'default' (libggml's choice) and/or variant names")
    ap.add_argument("--python", action="append", default=[], metavar="LABEL=PATH",
                    help="another installation's python, run with its default variant")
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("-p", "--n-prompt", type=int, default=64)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args(argv)
    models = [("stock", args.gguf), ("plugin dense", args.dir)]
    models = [(s, m) for s, m in models if m]
    if not models:
        ap.error("give --gguf and/or --dir")
    setups = []
    for v in args.variants.split(","):
        v = v.strip()
        setups.append((v, sys.executable, {} if v == "default" else {"LEANSTREAM_GGML_CPU": v}))
    for spec in args.python:
        label, _, path = spec.partition("=")
        if not path:
            ap.error(f"--python wants LABEL=PATH, got {spec!r}")
        setups.append((label, path, {}))
    runs: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.rounds):
        for system, model in models:
            for label, python, env in setups:
                res = bench_once(python, model, env, args)
                runs.setdefault((system, label), []).append(res)
                print(f"round {rnd + 1}/{args.rounds} {system:12s} {label:10s} decode {res['decode_tok_s']:7.2f} "
                      f"prefill {res['prefill_tok_s']:7.2f} tok/s ({res['ggml_cpu']})", file=sys.stderr, flush=True)
    rows = []
    for (system, label), rs in runs.items():
        rows.append({"system": system, "setup": label, "ggml_cpu": rs[0]["ggml_cpu"],
                     "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                     "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in rs),
                     "decode_runs": [round(r["decode_tok_s"], 3) for r in rs],
                     "prefill_runs": [round(r["prefill_tok_s"], 3) for r in rs]})
    for row in rows:
        base = next((r for r in rows if r["system"] == row["system"] and r["setup"] == "haswell"), None)
        if base:
            row["decode_x_haswell"] = row["decode_tok_s"] / base["decode_tok_s"]
            row["prefill_x_haswell"] = row["prefill_tok_s"] / base["prefill_tok_s"]
    from leanstream_tools import measure

    print(json.dumps({"rows": rows, "rounds": args.rounds, "n_prompt": args.n_prompt, "n_gen": args.n_gen,
                      "threads": args.threads, "gguf": args.gguf, "dir": args.dir,
                      "machine": measure.machine_info()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
