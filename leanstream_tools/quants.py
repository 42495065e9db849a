"""Smaller quantizations of a GGUF, made with llama.cpp's own quantizer: a stock user's honest
alternative at a memory limit is the largest quantization of the same model that fits.

    python -m leanstream_tools.quants MODEL --types Q3_K_M,Q2_K

llama-cpp-python binds ``llama_model_quantize`` (what the ``llama-quantize`` tool runs). The
registry only has the Q4_K_M file, so the smaller types are RE-quantized from it
(``allow_requantize``): every tensor is dequantized from its Q4_K_M-mix type and quantized again,
so the result is somewhat worse than quantizing the original f16 weights to the same type would
be. Without an importance matrix, as ``llama-quantize`` runs by default. Written next to the
source in the model cache as ``<stem>.<TYPE>-from-<SOURCE TYPE>.gguf``, under a temporary name
first; made once and reused.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# llama_ftype values (llama.h) of the types offered here
# (the IQ1 / IQ2 types are left out: llama.cpp quantizes them only with an importance matrix)
FTYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12,
          "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "IQ3_XXS": 23,
          "IQ4_NL": 25, "IQ3_S": 26, "IQ3_M": 27, "IQ4_XS": 30, "BF16": 32}


def source_type(src: Path) -> str:
    """The quantization named in the file name (``...Q4_K_M.gguf`` -> "Q4_K_M"), else "src"."""
    stem = src.name.upper()
    return next((t for t in sorted(FTYPES, key=len, reverse=True) if f".{t}." in stem or f"-{t}." in stem), "src")


def requantized_path(src: Path, qtype: str) -> Path:
    stem = src.name[:-len(".gguf")] if src.name.endswith(".gguf") else src.name
    st = source_type(src)
    if st != "src" and stem.upper().endswith(st):
        stem = stem[:-len(st)].rstrip(".-_")
    return src.with_name(f"{stem}.{qtype}-from-{st}.gguf")


def requantize(src: str | os.PathLike, qtype: str, *, n_threads: int | None = None, log=None) -> Path:
    """``src`` quantized to ``qtype`` by llama.cpp (made on first use, then reused)."""
    import llama_cpp

    qtype = qtype.upper()
    if qtype not in FTYPES:
        raise ValueError(f"unknown quantization {qtype!r} (known: {', '.join(FTYPES)})")
    src = Path(src)
    out = requantized_path(src, qtype)
    if out.exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[qtype]
    params.nthread = n_threads or len(os.sched_getaffinity(0))
    params.allow_requantize = True
    t0 = time.perf_counter()
    if log:
        log(f"quantizing {src.name} -> {out.name} (llama_model_quantize, re-quantized from {source_type(src)})")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize {src} -> {qtype} failed (status {rc})")
    os.replace(tmp, out)
    if log:
        log(f"wrote {out.name}: {out.stat().st_size / 1e6:.0f} MB in {time.perf_counter() - t0:.0f} s")
    return out


def main(argv=None) -> int:
    from leanstream_ggml.model import registry

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="GGUF path or model recipe name")
    ap.add_argument("--types", default="Q3_K_M,Q2_K", help="comma list of target types")
    ap.add_argument("-t", "--threads", type=int, default=None)
    args = ap.parse_args(argv)
    src = registry.resolve(args.model)
    for t in args.types.split(","):
        print(requantize(src, t.strip(), n_threads=args.threads, log=lambda m: print(m, file=sys.stderr)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
