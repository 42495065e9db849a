"""Fuzz loop over a model directory, run as a child process by tests/native/test_fuzz.py (a crash or
hang here is seen by the parent, with the case that caused it).

    python tests/support/fuzz_worker.py PRISTINE_DIR WORK_DIR N_CASES SEED

Each case copies the pristine model directory, corrupts one of its files (seeded: bit flips,
overwritten or zeroed runs, truncation, appended bytes), opens it and decodes in every
configuration. Each configuration must end in a clean error (ValueError family, e.g.
ManifestError/ParameterError, or LeanstreamError) or produce exactly the pristine output
(tokens and logits bit for bit). One JSON line per event on stdout: {"start": i, ...} before a
case runs, {"case": i, ...} after, {"done": n} at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostile_model import HAVE_TORCH, run_model  # noqa: E402

from leanstream_ggml.native._native import LeanstreamError  # noqa: E402

CONFIGS = [{"mode": "dense"}] + ([{"mode": "leanstream", "sparsity": 0.5}] if HAVE_TORCH else [])
KINDS = ("flip_one_bit", "flip_bits", "overwrite", "zero_run", "truncate", "append")


def corrupt(path: Path, rng: np.random.Generator) -> str:
    data = bytearray(path.read_bytes())
    n = len(data)
    kind = KINDS[int(rng.integers(len(KINDS)))]
    if n == 0:
        kind = "append"
    if kind == "flip_one_bit":
        p = int(rng.integers(0, n))
        data[p] ^= 1 << int(rng.integers(8))
        what = f"flipped 1 bit at {p}"
    elif kind == "flip_bits":
        k = int(rng.integers(1, 21))
        pos = rng.integers(0, n, size=k)
        for p in pos:
            data[int(p)] ^= 1 << int(rng.integers(8))
        what = f"flipped {k} bits"
    elif kind == "overwrite":
        ln = int(rng.integers(1, min(64, n) + 1))
        p = int(rng.integers(0, n - ln + 1))
        data[p:p + ln] = rng.integers(0, 256, size=ln, dtype=np.uint8).tobytes()
        what = f"overwrote {ln} bytes at {p}"
    elif kind == "zero_run":
        ln = int(rng.integers(1, min(4096, n) + 1))
        p = int(rng.integers(0, n - ln + 1))
        data[p:p + ln] = bytes(ln)
        what = f"zeroed {ln} bytes at {p}"
    elif kind == "truncate":
        p = int(rng.integers(0, n))
        del data[p:]
        what = f"truncated to {p} bytes"
    else:
        ln = int(rng.integers(1, 4097))
        data += rng.integers(0, 256, size=ln, dtype=np.uint8).tobytes()
        what = f"appended {ln} bytes"
    path.write_bytes(bytes(data))
    return what


def outcome(model_dir: Path, cfg: dict, expect) -> dict:
    try:
        out = run_model(model_dir, **cfg)
    except (ValueError, LeanstreamError) as e:
        return {"outcome": "error", "type": type(e).__name__, "msg": str(e)[:300]}
    except Exception as e:  # anything else is not a clean error
        return {"outcome": "unclean", "type": type(e).__name__, "msg": str(e)[:300]}
    return {"outcome": "identical" if out == expect else "DIFFERENT"}


def main() -> int:
    pristine, work, n_cases, seed = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    expected = []
    for cfg in CONFIGS:
        a, b = run_model(pristine, **cfg), run_model(pristine, **cfg)
        if a != b:
            print(json.dumps({"nondeterministic": cfg}), flush=True)
            return 2
        expected.append(a)
    files = sorted(str(p.relative_to(pristine)) for p in pristine.rglob("*") if p.is_file())
    print(json.dumps({"files": files, "configs": CONFIGS}), flush=True)
    rng = np.random.default_rng(seed)
    for i in range(n_cases):
        case_dir = work / "case"
        if case_dir.exists():
            shutil.rmtree(case_dir)
        shutil.copytree(pristine, case_dir)
        rel = files[i % len(files)]                       # every file in turn
        case_rng = np.random.default_rng([seed, i])
        what = corrupt(case_dir / rel, case_rng)
        print(json.dumps({"start": i, "file": rel, "corruption": what}), flush=True)
        results = [outcome(case_dir, cfg, exp) for cfg, exp in zip(CONFIGS, expected)]
        print(json.dumps({"case": i, "file": rel, "corruption": what, "results": results}), flush=True)
    del rng
    print(json.dumps({"done": n_cases}), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
