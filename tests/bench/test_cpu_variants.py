"""llama.cpp's CPU backend as one module per instruction set (GGML_BACKEND_DL, leanstream_ggml/build.py
CPU_VARIANTS): the wheel holds every variant, libggml loads the one ggml's own scorer ranks best
for this CPU (checked against a Python copy of that scorer and /proc/cpuinfo), the native library
finds that module's type traits, LEANSTREAM_GGML_CPU picks another, and the answers do not depend
on the variant beyond floating-point rounding. (That the haswell module gives the bits the
AVX2-only build gave, stock and plugin, was checked once when the build changed: identical
logits; bench/results/README.md.)"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from leanstream_ggml.native import _native
from leanstream_ggml import build

from logits import agreement_and_kl

X86_LINUX = platform.machine() in ("x86_64", "AMD64") and Path("/proc/cpuinfo").exists()

# ggml_backend_cpu_x86_score (ggml/src/ggml-cpu/arch/x86/cpu-feats.cpp): a variant scores 0 when
# the CPU lacks one of its features, else 1 + the weights of its features; the highest wins.
# The features, as /proc/cpuinfo spells them, of each variant (ggml/src/CMakeLists.txt).
_AVX512 = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")
_WEIGHT = {"fma": 1, "f16c": 2, "sse4_2": 4, "bmi2": 8, "avx": 16, "avx2": 32, "avx_vnni": 64,
           "AVX512": 128, "avx512vbmi": 256, "avx512_bf16": 512, "avx512_vnni": 1024}
_HASWELL = ("sse4_2", "avx", "f16c", "fma", "avx2", "bmi2")
VARIANT_FEATURES = {
    "haswell": _HASWELL,
    "skylakex": _HASWELL + ("AVX512",),
    "cascadelake": _HASWELL + ("AVX512", "avx512_vnni"),
    "icelake": _HASWELL + ("AVX512", "avx512vbmi", "avx512_vnni"),
    "zen4": _HASWELL + ("AVX512", "avx512vbmi", "avx512_vnni", "avx512_bf16"),
    "alderlake": _HASWELL + ("avx_vnni",),
}


def ggml_score(features: tuple[str, ...], cpu_flags: set[str]) -> int:
    score = 1
    for f in features:
        have = all(g in cpu_flags for g in _AVX512) if f == "AVX512" else f in cpu_flags
        if not have:
            return 0
        score += _WEIGHT[f]
    return score


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def variant() -> str:
    return _native.ffi.string(_native.lib.ls_ggml_cpu_variant()).decode()


def test_the_build_holds_every_variant_and_no_amx():
    assert _native.cpu_variants() == sorted(build.CPU_VARIANTS)
    assert set(VARIANT_FEATURES) == set(build.CPU_VARIANTS)   # the reference scorer knows each one
    assert "sapphirerapids" not in _native.cpu_variants()
    lib_dir = Path(_native.ffi.string(_native.lib.ls_ggml_cpu_path()).decode()).parent
    assert not (lib_dir / "libggml-cpu.so").exists()      # no unsuffixed module that would shadow them


@pytest.mark.skipif(not X86_LINUX, reason="ggml's x86 scorer, read against /proc/cpuinfo")
def test_the_loaded_variant_is_the_one_ggmls_scorer_ranks_best_for_this_cpu():
    flags = cpu_flags()
    scores = {v: ggml_score(f, flags) for v, f in VARIANT_FEATURES.items()}
    best = max(scores, key=scores.get)
    assert scores[best] > 0, f"this CPU runs none of the variants: {sorted(flags)}"
    assert variant() == best, scores
    assert Path(_native.ffi.string(_native.lib.ls_ggml_cpu_path()).decode()).name == f"libggml-cpu-{best}.so"


def _run(code: str, env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).parents[2], timeout=600)


def test_an_unknown_variant_is_refused_with_the_list():
    r = _run("import leanstream_ggml.native._native", {"LEANSTREAM_GGML_CPU": "pentium4"})
    assert r.returncode != 0
    assert "LEANSTREAM_GGML_CPU=pentium4" in r.stderr and "haswell" in r.stderr


# one child per variant: the variant is chosen once per process, at the first backend load
_CHILD = r"""
import json, sys
import numpy as np
import llama_cpp
from leanstream_ggml import Llama
from leanstream_ggml.native import _native
sys.path.insert(0, "tests/support")
from logits import teacher_forced
model_dir, text, out = sys.argv[1], sys.argv[2], sys.argv[3]
llm = Llama(model_dir, mode="dense", n_ctx=256, n_threads=2, logits_all=True, verbose=False)
toks = llm.tokenize(text.encode())[:96]
np.save(out, teacher_forced(llm, toks).astype(np.float32))
llm.reset()
gen = llm.create_completion(text[:200], max_tokens=24, temperature=0.0)["choices"][0]["text"]
print(json.dumps({"variant": _native.ffi.string(_native.lib.ls_ggml_cpu_variant()).decode(), "text": gen}))
"""


@pytest.mark.skipif(not X86_LINUX, reason="x86 CPU variants")
def test_the_haswell_variant_is_loaded_on_request_and_answers_agree(smollm2_dir, prose, tmp_path):
    runs = {}
    for name, env in (("haswell", {"LEANSTREAM_GGML_CPU": "haswell"}), ("default", {})):
        out = tmp_path / f"{name}.npy"
        r = _run(_CHILD, env, str(smollm2_dir), prose[:1500], str(out))
        assert r.returncode == 0, r.stderr[-2000:]
        runs[name] = (json.loads(r.stdout.strip().splitlines()[-1]), np.load(out))
    (h, lh), (d, ld) = runs["haswell"], runs["default"]
    assert h["variant"] == "haswell"
    assert d["variant"] == variant()
    if d["variant"] == "haswell":                 # an AVX2-only host: the same module, the same bits
        np.testing.assert_array_equal(lh, ld)
        assert h["text"] == d["text"]
    else:
        # zen4 and haswell sum in another order: rounding only. Measured on SmolLM2 (96 prose
        # tokens): haswell vs zen4 top-1 agreement 0.95 for stock llama.cpp itself, 0.95-0.99 for
        # the plugin; per-position KL mean 2e-3-4e-3, max 1e-2-2e-2 (a small model's flat
        # distributions flip on such rounding). A wrong kernel or type trait shows as KL ~1.
        agree, kl = agreement_and_kl(lh.astype(np.float64), ld.astype(np.float64))
        assert agree >= 0.9, agree
        assert float(kl.mean()) < 0.01 and float(kl.max()) < 0.1, (float(kl.mean()), float(kl.max()))


def test_the_variant_benchmark_runs_each_variant_it_names(smollm2_gguf, smollm2_dir):
    import contextlib
    import io

    import bench_modules

    cv = bench_modules.load("cpu_variants")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cv.main(["--gguf", str(smollm2_gguf), "--dir", str(smollm2_dir), "--variants", "default,haswell",
                        "-r", "1", "-p", "8", "-n", "4", "-t", "2"]) == 0
    doc = json.loads(buf.getvalue())
    got = {(r["system"], r["setup"]): r for r in doc["rows"]}
    assert set(got) == {(s, v) for s in ("stock", "plugin dense") for v in ("default", "haswell")}
    for (system, setup), r in got.items():
        assert r["ggml_cpu"] == (variant() if setup == "default" else setup)
        assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
        assert r["decode_x_haswell"] > 0
    assert got[("stock", "haswell")]["decode_x_haswell"] == 1.0
