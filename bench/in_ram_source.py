"""In RAM, a directory converted into another folder than its source against stock on the source.

    python bench/in_ram_source.py --model qwen2.5-coder-1.5b-instruct --out bench/results/in-ram-source-DATE.json

Converts the model (a recipe name or a GGUF path) into a temporary folder apart from the GGUF
(``--sketch none``: what runs in RAM needs no sketch), then decodes the same prompt greedily,
each system in a fresh process, interleaved for --rounds: stock (llama_cpp.Llama on the GGUF) and
the plugin (leanstream_ggml.Llama on the directory, every option its default: no limit, so it runs
the GGUF it was converted from, found where the manifest recorded it, on llama.cpp wherever
llama.cpp repacks its FFN weights; leanstream_ggml/llamacpp/stock.py). Prints decode tok/s per run, the
plugin's backend and source, and the plugin/stock ratio of the medians.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchkit

PROMPT = "def quicksort(items):\n"


def child(a: dict) -> dict:
    import numpy as np

    if a["system"] == "stock":
        import llama_cpp

        llm = llama_cpp.Llama(a["gguf"], n_ctx=512, n_threads=a["threads"], verbose=False)
        where = {"backend": "llama_cpp"}
    else:
        from leanstream_ggml import Llama

        llm = Llama(a["model_dir"], n_ctx=512, n_threads=a["threads"], verbose=False)
        where = {"backend": llm.backend, "source": str(llm.source_path), "stock_reason": llm.stock_reason}
    toks = llm.tokenize(PROMPT.encode(), add_bos=True)
    llm.eval(toks)
    tok, out = int(np.argmax(llm.scores[llm.n_tokens - 1])), []
    t0 = time.perf_counter()
    for _ in range(a["n_gen"]):
        out.append(tok)
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    dt = time.perf_counter() - t0
    llm.close()
    return {"system": a["system"], "tok_s": a["n_gen"] / dt, "tokens": out, **where}


def main(argv=None) -> int:
    ap = benchkit.parser(__doc__, child=True)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.child:
        return benchkit.answer_child(a.child, child)
    from leanstream_ggml.model import registry

    gguf = registry.resolve(a.model)
    with tempfile.TemporaryDirectory(prefix="leanstream-in-ram-") as tmp:
        out_dir = Path(tmp) / "elsewhere" / "m.lsm"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "convert", str(gguf), str(out_dir),
                        "--sketch", "none", "--quiet"], check=True)
        convert_s = time.perf_counter() - t0
        runs = []
        for r in range(a.rounds):
            for system in ("stock", "plugin"):
                res, _ = benchkit.run_child(__file__, {"system": system, "gguf": str(gguf), "model_dir": str(out_dir),
                                                       "threads": a.threads, "n_gen": a.n_gen})
                runs.append({"round": r, **res})
                print(f"round {r} {system}: {res['tok_s']:.2f} tok/s ({res['backend']})", file=sys.stderr)
    med = {s: statistics.median(x["tok_s"] for x in runs if x["system"] == s) for s in ("stock", "plugin")}
    same = all(x["tokens"] == runs[0]["tokens"] for x in runs)
    doc = {"benchmark": "in_ram_source", "model": gguf.name, "convert_s": round(convert_s, 1),
           "tok_s_median": med, "plugin_over_stock": med["plugin"] / med["stock"], "same_tokens": same,
           "runs": [{k: v for k, v in x.items() if k != "tokens"} for x in runs]}
    return benchkit.emit(doc, a.out)


if __name__ == "__main__":
    sys.exit(main())
