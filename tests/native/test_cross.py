"""The native library on 64-bit ARM, tested on this x86 machine: libleanstream, its C tests and ggml
cross-compiled for aarch64 (`python -m leanstream_ggml.build --cross aarch64`, Debian's
gcc-aarch64-linux-gnu) and run under qemu-user. What runs there (native/tests/*.c):

- test_api: the ABI, the mode table, CRC-32C against its reference, the error paths;
- test_kernels: every FFN kernel path the emulated CPU offers against the scalar reference, the
  rows kernels bit for bit against the one-row kernels; once on a CPU with the dot-product
  extension (Cortex-A76) and once without (Cortex-A53);
- test_engine: the I/O engine reading a converted synthetic model's block file (O_DIRECT) and the
  dense op computing it, compared here with the numpy reference, as test_kernels.py does on x86.

Where the cross tools are missing the tests skip, saying which packages to install; with
LEANSTREAM_REQUIRE_CROSS=1 (set by .ci/run) they fail instead.

The same test_engine program also runs natively, so that the comparison itself is tested on x86.
"""

from __future__ import annotations

import os
import shutil
import sys
import subprocess
from pathlib import Path

import numpy as np
import pytest

from c_tests import build as build_here
from c_tests import run as _run
from leanstream_convert import convert
from gguf_synth import write_tiny_model
from reference import ffn_reference, load_layer

REPO = Path(__file__).resolve().parents[2]
TARGET = "aarch64"
AARCH64_MACHINE = 183            # ELF e_machine of EM_AARCH64


def _cross_or_skip():
    from leanstream_ggml import build

    try:
        return build.cross_tools(TARGET)
    except build.BuildError as e:
        if os.environ.get("LEANSTREAM_REQUIRE_CROSS") == "1":
            pytest.fail(str(e))
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def cross():
    """(the cross build's folder, the qemu command prefix)."""
    tools = _cross_or_skip()
    from leanstream_ggml import build

    r = subprocess.run([sys.executable, "-m", "leanstream_ggml.build", "--cross", TARGET],
                       cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    bdir = build.cross_native_dir(TARGET)
    return bdir, [tools["qemu"], "-L", tools["sysroot"]]


def test_the_library_is_built_for_aarch64(cross):
    bdir, _ = cross
    head = (bdir / "libleanstream.so").read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == AARCH64_MACHINE


def test_c_api_on_aarch64(cross, tmp_path):
    bdir, qemu = cross
    _run([*qemu, bdir / "test_api", tmp_path])


@pytest.mark.parametrize("cpu", ["cortex-a76", "cortex-a53"])   # with and without the dot product
def test_kernels_on_aarch64(cross, cpu):
    bdir, qemu = cross
    if not (bdir / "test_kernels").exists():
        pytest.fail("native/tests/test_kernels.c was not built")
    r = _run([*qemu, "-cpu", cpu, bdir / "test_kernels"])
    assert "kernels:" in r.stdout


CASES = {
    "q4_K": ({"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, "q6_k", "silu"),   # Qwen2.5's Q4_K_M FFN
    "q4_1": ({"ffn": "Q4_1"}, "q8_0", "silu"),                                 # SmolLM2's Q4_1
    "gelu-q8_0": ({"ffn": "Q8_0"}, "q8_0", "gelu"),   # the Gemma activation (the engine is told it)
}


@pytest.fixture(scope="module", params=list(CASES))
def layer(request, tmp_path_factory):
    types, down, activation = CASES[request.param]
    d = tmp_path_factory.mktemp("x")
    write_tiny_model(d / "m.gguf", arch="llama", n_layer=1, n_embd=512,
                     n_ff=768, types=types, seed=11)
    m = convert(d / "m.gguf", d / "lsm", progress=False, sketch="none", down_type=down)
    return request.param, m.layer_path(d / "lsm", 0), activation


def _engine_check(cmd_prefix, exe, layer, tmp_path, n_tokens):
    case, path, activation = layer
    x = np.random.default_rng(n_tokens).standard_normal((n_tokens, 512)).astype(np.float32)
    x.tofile(tmp_path / "x.bin")
    r = _run([*cmd_prefix, exe, path, tmp_path / "x.bin", n_tokens, activation, tmp_path / "y.bin"])
    y = np.fromfile(tmp_path / "y.bin", np.float32).reshape(n_tokens, 512)
    want = ffn_reference(load_layer(path), x, activation=activation)
    rtol = 5e-3 if case == "q4_1" else 1e-3   # Q8_1's f16 block sums (as in test_kernels.py)
    err = np.abs(y - want).max()
    assert err <= rtol * np.abs(want).max() + 1e-5, (case, n_tokens, err, r.stdout)
    return r


@pytest.mark.parametrize("n_tokens", [1, 5, 70])   # one token, a verify pass, a prefill
def test_engine_on_aarch64(cross, layer, tmp_path, n_tokens):
    bdir, qemu = cross
    _engine_check(qemu, bdir / "test_engine", layer, tmp_path, n_tokens)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on PATH")
@pytest.mark.parametrize("n_tokens", [1, 5, 70])
def test_engine_program_on_this_machine(layer, tmp_path, n_tokens):
    exe = build_here("test_engine", tmp_path)
    _engine_check([], exe, layer, tmp_path, n_tokens)


# ---- a whole model: the patched libllama with the FFN op, decoding greedily -----------------------

# prose, code, a question: none used to tune anything
PROMPTS = ["The capital of France is", "def is_prime(n):\n    ", "Q: Why is the sky blue?\nA:"]
N_PREDICT = 12


def _decode_args(model_dir: Path, prompt_tokens: list[int]) -> list:
    from leanstream_ggml.model import manifest

    m = manifest.load(model_dir)
    return [m.resolve(model_dir, m.base.file), m.activation, N_PREDICT, ",".join(map(str, prompt_tokens)),
            *[m.resolve(model_dir, e.file) for e in m.layers]]


def _tokens(r: subprocess.CompletedProcess) -> list[int]:
    line = next(x for x in r.stdout.splitlines() if x.startswith("tokens:"))
    return [int(t) for t in line.split()[1:]]


@pytest.fixture(scope="module", params=range(len(PROMPTS)), ids=["prose", "code", "question"])
def smollm2_plain(smollm2_dir, request):
    """A prompt's tokens and the Python Llama's greedy continuation in dense mode, speculation off,
    with each step's runner-up token and its logit margin to the chosen one (``runners``)."""
    import numpy as np

    from leanstream_ggml import Llama

    llm = Llama(str(smollm2_dir), mode="dense", speculative="off", n_ctx=256, n_threads=2, verbose=False)
    try:
        toks = llm.tokenize(PROMPTS[request.param].encode(), add_bos=True, special=False)
        out, runners = [], []
        for t in llm.generate(toks, top_k=1, temp=0.0, reset=True):
            z = llm.logits()
            second = int(np.argsort(z)[-2])
            out.append(t)
            runners.append((second, float(z[t] - z[second])))
            if len(out) == N_PREDICT:
                break
    finally:
        llm.close()
    return toks, out, runners


def _same_or_near_tie(got: list[int], want: list[int], runners: list) -> None:
    """Another ISA's greedy tokens equal these up to the end, or up to a step where this machine's
    model itself nearly tied (the other took its runner-up, within 0.5 of a logit: ggml's ARM and
    x86 kernels round differently, and a near-tie may go either way)."""
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        assert len(got) == len(want)
        return
    second, margin = runners[i]
    assert got[i] == second and margin < 0.5, (i, got, want, runners[i])


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on PATH")
def test_c_host_decodes_as_the_python_binding(smollm2_dir, smollm2_plain, tmp_path):
    """native/tests/test_decode.c on this machine: the same tokens as the Python Llama."""
    exe = build_here("test_decode", tmp_path)
    toks, want, _ = smollm2_plain
    r = _run([exe, *_decode_args(smollm2_dir, toks)])
    assert _tokens(r) == want


# the emulated CPU, the op's kernels and the ggml CPU variant that must be chosen on it
ARM_CPUS = {"cortex-a76": ("neon+dotprod", "armv8.2_2"), "cortex-a53": ("neon", "armv8.0_1")}


@pytest.mark.parametrize("cpu", list(ARM_CPUS))
def test_aarch64_decodes_as_x86(cross, smollm2_dir, smollm2_plain, cpu):
    """The aarch64 build under qemu (ggml's variant for that CPU, loaded at run time as on a
    board, and the op's NEON kernels) decodes SmolLM2's greedy continuation to the same tokens as
    this machine's build, or to the same tokens up to a near-tie of this machine's model."""
    bdir, qemu = cross
    toks, want, runners = smollm2_plain
    r = _run([*qemu, "-cpu", cpu, bdir / "test_decode", *_decode_args(smollm2_dir, toks)])
    kernels, variant = ARM_CPUS[cpu]
    assert f"kernels: {kernels}, ggml CPU backend {variant}\n" in r.stdout, r.stdout[-2000:]
    _same_or_near_tie(_tokens(r), want, runners)
