"""Predictor metrics: hashing vs DejaVu-style MLP vs oracle, by refinement stage (paper Fig. 12).

    python bench/predictor_metrics.py smollm2=/path/to/model_dir [qwen=...] [--plot out.png]

Each model_dir holds predictor/blk.<il>.lspred and predictor/predictor.json as written by
`leanstream train-predictor` (or the converter). The accuracy numbers come from that training
run's held-out evaluation (scored through the C evaluator); this script re-checks C == torch
inference on random inputs, then times one C call per layer (median of repeats), and prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def latency_us(path, repeats: int = 2000) -> float:
    import cffi

    from leanstream_convert.train.export import NativePredictor

    ffi = cffi.FFI()   # float buffers only: cffi's primitive types are one across its FFI objects
    with NativePredictor(path) as c:
        x = ffi.new("float[]", np.random.default_rng(0).standard_normal(c.n_embd).astype(np.float32).tolist())
        y = ffi.new("float[]", c.n_blocks)
        for _ in range(50):
            c.eval_into(x, y)
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(repeats // 7):
                c.eval_into(x, y)
            ts.append((time.perf_counter() - t0) / (repeats // 7))
    return float(np.median(ts) * 1e6)


def check_exact(path) -> bool:
    from leanstream_convert.train.export import NativePredictor, read_predictor

    hdr, params = read_predictor(path)
    x = np.random.default_rng(1).standard_normal((64, hdr["n_embd"])).astype(np.float32) * 3
    try:
        from leanstream_convert.train.hashing import infer_params
    except ImportError:
        return True   # no torch: nothing to compare against
    ref = infer_params(params, hdr["tau"], hdr["n_tables"], x).numpy()
    with NativePredictor(path) as c:
        return bool(np.array_equal(c(x).view(np.uint32), ref.view(np.uint32)))


def one_model(model_dir: Path) -> dict:
    from leanstream_ggml.model import manifest as mf

    s = json.loads((model_dir / mf.PREDICTOR_SUMMARY).read_text())
    files = [model_dir / f for f in s["files"]]
    exact = all(check_exact(f) for f in files[:3])
    lat = [latency_us(f) for f in files[:: max(1, len(files) // 4)]]
    out = {
        "layers": len(files),
        "c_equals_torch": exact,
        "hashing_bytes_total": s["bytes"],
        "hashing_bytes_per_layer": s["bytes_per_layer"],
        "mlp_bytes_total": s.get("mlp_bytes"),
        "c_latency_us_per_call": round(float(np.median(lat)), 1),
        "profile_seconds": s.get("profile_seconds"),
        "train_seconds_hashing": s["train_seconds"],
        "train_seconds_mlp": s.get("mlp_train_seconds"),
        "n_tokens_train": s["n_tokens_train"], "n_tokens_eval": s["n_tokens_eval"],
        "config": s["config"],
        "oneshot": s["oneshot_mean"],
        "refinement_layers": s["curve_layers"],
        "refinement": s["refinement"],
    }
    return out


def plot(results: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 4 * len(names)), squeeze=False)
    colors = {"0.5": "C0", "0.7": "C1", "0.8": "C2", "0.9": "C3"}
    styles = {"hashing": "-", "mlp": "--", "oracle": ":"}
    for r, name in enumerate(names):
        ref = results[name]["refinement"]
        for c, key in enumerate(("recall_top10", "importance_ratio")):
            ax = axes[r][c]
            for method, per_s in ref.items():
                for s, d in per_s.items():
                    ax.plot(range(len(d[key])), d[key], styles.get(method, "-"), color=colors.get(s),
                            label=f"{method} s={s}")
            ax.set_xlabel("refinement stage j (of 8)")
            ax.set_ylabel(key)
            ax.set_title(f"{name}: {key}")
            ax.grid(alpha=0.3)
        axes[r][0].legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", help="name=model_dir")
    ap.add_argument("--plot", default=None, help="PNG of the refinement curves")
    args = ap.parse_args(argv)
    results = {}
    for spec in args.models:
        name, _, d = spec.partition("=")
        results[name] = one_model(Path(d or name))
    if args.plot:
        plot(results, args.plot)
    print(json.dumps(results))
    return 0 if all(r["c_equals_torch"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
