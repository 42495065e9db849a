"""The FFN kernels on every instruction set this CPU runs (AVX2 always; AVX-512 where the CPU has it),
against the numpy reference, and the plain memory-read baseline the kernel benchmark compares with.

The kernels are chosen once per process; LEANSTREAM_ISA=avx2 and ls_kernels_select() choose again,
so one run covers the AVX2 kernels even on an AVX-512 machine. The fused gate/up kernels (Q4_K,
Q4_1 rows), the prefill kernel (4 tokens per pass, and the tokens left over) and the down
projections (Q8_0 columns for decode, the register-blocked tile for prefill) all run here.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from converters import convert
from gguf_synth import write_tiny_model
from leanstream_ggml._native import ffi, lib
from leanstream_ggml.engine import FFNEngine
from leanstream_ggml.reference import ffn_reference, load_layer

N_EMBD, N_FF = 512, 768   # down rows are n_ff values long: Q6_K needs multiples of 256

CASES = {
    "q4_K": {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"},   # Qwen2.5's Q4_K_M FFN
    "q4_1": {"ffn": "Q4_1"},                                   # SmolLM2's Q4_1
}


@pytest.fixture(scope="module", params=list(CASES))
def layer(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("k")
    write_tiny_model(d / "m.gguf", arch="llama", n_layer=1, n_embd=N_EMBD, n_ff=N_FF, types=CASES[request.param], seed=5)
    m = convert(d / "m.gguf", d / "lsm", progress=False)
    return request.param, m.layer_path(d / "lsm", 0)


def _isas() -> list[str]:
    lib.ls_kernels_select()
    native = ffi.string(lib.ls_kernel_isa()).decode()
    return ["avx2"] + (["native"] if native == "avx512" else [])


@pytest.fixture(params=_isas())
def isa(request, monkeypatch):
    if request.param == "avx2":
        monkeypatch.setenv("LEANSTREAM_ISA", "avx2")
    else:
        monkeypatch.delenv("LEANSTREAM_ISA", raising=False)
    lib.ls_kernels_select()
    yield ffi.string(lib.ls_kernel_isa()).decode()
    monkeypatch.delenv("LEANSTREAM_ISA", raising=False)
    lib.ls_kernels_select()


def test_isa_is_reported():
    lib.ls_kernels_select()
    name = ffi.string(lib.ls_kernel_isa()).decode()
    assert name in ("avx2", "avx512") or name.startswith("avx2 (")
    if name.startswith("avx2 ("):
        pytest.fail(f"the AVX-512 kernels disagree with the AVX2 ones on this CPU: {name}")


@pytest.mark.parametrize("n_tokens", [1, 2, 9])
def test_kernels_match_reference(layer, isa, n_tokens):
    case, path = layer
    w = load_layer(path)
    rtol = 5e-3 if case == "q4_1" else 1e-3   # Q8_1's f16 block sums (see test_op)
    x = np.random.default_rng(n_tokens).standard_normal((n_tokens, N_EMBD)).astype(np.float32)
    with FFNEngine([path]) as e:
        y = e.eval_layer(0, x, n_threads=2)
    want = ffn_reference(w, x)
    err = np.abs(y - want).max()
    assert err <= rtol * np.abs(want).max() + 1e-5, f"{isa}: max err {err}"


@pytest.mark.parametrize("n,threads", [(64 * 1024, 1), (3 * 64 * 1000, 3), (1000, 2)])
def test_memory_read_reads_every_byte(n, threads):
    buf = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    got = lib.ls_memory_read(ffi.cast("const void *", buf.ctypes.data), n, threads)
    # the xor of every 64-bit word when each thread's share is whole 64-byte lines; else bytes fold in
    if n % (64 * threads) == 0:
        assert got == int(np.bitwise_xor.reduce(buf.view(np.uint64)))
    buf[n // 2] ^= 0xFF
    assert lib.ls_memory_read(ffi.cast("const void *", buf.ctypes.data), n, threads) != got
