"""The FFN kernels on every instruction set this CPU runs (the scalar C everywhere; AVX2 and, where
the CPU has it, AVX-512 on x86-64; NEON on aarch64), against the numpy reference (the plain
memory-read baseline the kernel benchmark compares with is bench/memory_read.py, tested in
tests/bench/test_memory_read.py).

The kernels are chosen once per process; LEANSTREAM_ISA=<set> and ls_kernels_select() choose again,
so one run covers the scalar kernels (the reference the others are checked against at start-up)
and the AVX2 ones even on an AVX-512 machine. The fused gate/up kernels (Q4_K,
Q4_1 rows), the verify pass's rows kernels (each row as that token alone), the prefill kernel (4
tokens per pass, and the tokens left over) and the down projections (Q8_0 and Q6_K columns in
place for decode and verify passes, the register-blocked tile for prefill) all run here.
"""

from __future__ import annotations

import numpy as np
import pytest

from leanstream_convert import convert
from gguf_synth import write_tiny_model
from leanstream_ggml.native._native import ffi, lib
from leanstream_ggml.native.engine import FFNEngine
from reference import act, ffn_reference, load_layer, round_like_ggml

N_EMBD, N_FF = 512, 768   # down rows are n_ff values long: Q6_K needs multiples of 256

CASES = {
    "q4_K": {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"},   # Qwen2.5's Q4_K_M FFN
    "q4_1": {"ffn": "Q4_1"},                                   # SmolLM2's Q4_1
}
# (case, the down columns' format): both in-place down kernels on each row format
LAYERS = [(c, d) for c in CASES for d in ("q8_0", "q6_k")]


@pytest.fixture(scope="module", params=LAYERS, ids=[f"{c}-{d}" for c, d in LAYERS])
def layer(request, tmp_path_factory):
    case, down = request.param
    d = tmp_path_factory.mktemp("k")
    write_tiny_model(d / "m.gguf", arch="llama", n_layer=1, n_embd=N_EMBD, n_ff=N_FF, types=CASES[case], seed=5)
    m = convert(d / "m.gguf", d / "lsm", progress=False, sketch="none", down_type=down)
    return case, m.layer_path(d / "lsm", 0)


ISAS = ("scalar", "avx2", "avx512", "avx512vnni", "neon", "neon+dotprod")   # every set a build can have, from the bottom


def isas_here() -> list[str]:
    """The instruction sets this build and CPU run (ls_kernels_force takes them), the CPU's best last."""
    here = [name for name in ISAS if lib.ls_kernels_force(name.encode())]
    lib.ls_kernels_select()
    return here


@pytest.fixture(params=isas_here())
def isa(request, monkeypatch):
    """The kernels of one instruction set, chosen as a user would (LEANSTREAM_ISA)."""
    monkeypatch.setenv("LEANSTREAM_ISA", request.param)
    lib.ls_kernels_select()
    name = ffi.string(lib.ls_kernel_isa()).decode()
    assert name == request.param, f"a start-up check failed: {name}"
    yield name
    monkeypatch.delenv("LEANSTREAM_ISA", raising=False)
    lib.ls_kernels_select()


def test_isa_is_reported(monkeypatch):
    monkeypatch.delenv("LEANSTREAM_ISA", raising=False)
    lib.ls_kernels_select()
    name = ffi.string(lib.ls_kernel_isa()).decode()
    assert name.split(" ")[0] == isas_here()[-1]   # the CPU's best
    if "failed" in name:   # (a start-up check failed: what and why)
        pytest.fail(f"a start-up check of the kernels failed on this CPU: {name}")


def test_isa_asked_for_and_missing_is_said(monkeypatch):
    monkeypatch.setenv("LEANSTREAM_ISA", "no-such-set")
    lib.ls_kernels_select()
    name = ffi.string(lib.ls_kernel_isa()).decode()
    monkeypatch.delenv("LEANSTREAM_ISA")
    lib.ls_kernels_select()
    assert name.startswith(isas_here()[-1] + " (LEANSTREAM_ISA=no-such-set is none of this build's: scalar")


@pytest.mark.parametrize("n_tokens", [1, 2, 9, 70])   # 70: two prefill token chunks (64 + 6)
def test_kernels_match_reference(layer, isa, n_tokens):
    case, path = layer
    w = load_layer(path)
    rtol = 5e-3 if case == "q4_1" else 1e-3   # Q8_1's f16 block sums (see test_op)
    x = np.random.default_rng(n_tokens).standard_normal((n_tokens, N_EMBD)).astype(np.float32)
    want = ffn_reference(w, x)
    with FFNEngine([path]) as e:
        # the first call reads the blocks and, the whole layer being resident for good, rewrites
        # it in the split layout; the second computes on that layout
        for _ in range(2):   # reading the blocks, then on the resident layer
            y = e.eval_layer(0, x, n_threads=2)
            err = np.abs(y - want).max()
            assert err <= rtol * np.abs(want).max() + 1e-5, f"{isa}: max err {err}"
        assert e.layer_info(0)["split_layout"] == 0   # dense reads every part: no split


@pytest.mark.parametrize("n_tokens", [2, 3, 5, 8, 17, 64])
def test_a_verify_pass_row_equals_that_token_alone(layer, isa, n_tokens):
    """Up to LS_EXACT_ROWS rows (a verify pass) the op computes its rows together (the rows
    kernels: weights unpacked once per few rows, the down columns once for all rows), and every
    row of its output is bit for bit the one-token op's on that row, on the blocks as read and
    on the resident layer; the rows kernels themselves: test_row_kernels.py."""
    _, path = layer
    x = np.random.default_rng(n_tokens).standard_normal((n_tokens, N_EMBD)).astype(np.float32)
    with FFNEngine([path]) as e:
        for _ in range(2):   # the first op reads the blocks
            batch = e.eval_layer(0, x, n_threads=2)
            alone = np.concatenate([e.eval_layer(0, x[t:t + 1], n_threads=2) for t in range(n_tokens)])
            assert np.array_equal(batch, alone), isa


def test_prefill_tile_covers_widths_not_a_multiple_of_its_block(tmp_path, isa):
    """The prefill down projection keeps 4 tokens x 16 (AVX2, NEON) or 32 (AVX-512) outputs in
    registers; a width that is not a multiple of that (F16 down columns of 72 values here) and a
    token count that is not a multiple of 4 are finished by the plain loop."""
    write_tiny_model(tmp_path / "m.gguf", arch="llama", n_layer=1, n_embd=72, n_ff=96, n_head=2, n_head_kv=2,
                     types={"ffn": "F16"}, seed=8)
    path = convert(tmp_path / "m.gguf", tmp_path / "lsm", progress=False, sketch="none").layer_path(tmp_path / "lsm", 0)
    x = np.random.default_rng(3).standard_normal((11, 72)).astype(np.float32)
    want = ffn_reference(load_layer(path), x)
    with FFNEngine([path]) as e:
        y = e.eval_layer(0, x, n_threads=2)
    assert np.abs(y - want).max() <= 1e-3 * np.abs(want).max() + 1e-5, isa


@pytest.fixture(scope="module", params=["q8_0", "q6_k"])
def sketched(request, tmp_path_factory):
    """A Q4_K layer converted with the sketch (leanstream mode), no calibration; its down columns
    in Q8_0 or Q6_K (each added in place by its own kernel)."""
    from leanstream_convert.stages import convert_model

    d = tmp_path_factory.mktemp("ks")
    write_tiny_model(d / "m.gguf", arch="llama", n_layer=1, n_embd=N_EMBD, n_ff=N_FF, types=CASES["q4_K"], seed=6)
    m = convert_model(d / "m.gguf", d / "lsm", calibrate=False, progress=False, down_type=request.param)
    return m.resolve(d / "lsm", m.layers[0].file), m.resolve(d / "lsm", m.sketch_files()[0])


def test_split_layout_cascade_matches_reference(sketched, isa):
    """Once a prefill has made the layer resident for good, leanstream rewrites it in the split
    layout (all gate/up rows apart from all down columns) and selects from every block: the output
    is the FFN over the blocks with the largest exact |h|, on either layout."""
    path, sketch = sketched
    w = load_layer(path)
    rng = np.random.default_rng(4)
    with FFNEngine([path], mode="leanstream", sketch_paths=[sketch], sparsity=0.5) as e:
        e.eval_layer(0, rng.standard_normal((4, N_EMBD)).astype(np.float32), n_threads=2)   # prefill
        assert e.layer_info(0)["split_layout"] == 1
        nb = e.layer_info(0)["n_blocks"]
        for _ in range(2):
            x = rng.standard_normal((1, N_EMBD)).astype(np.float32)
            y = e.eval_layer(0, x, n_threads=2, x_res=x)
            kept = e.last_plan(0)
            assert len(e.last_candidates(0)) == nb and len(kept) == int(lib.ls_kept_blocks(nb, 0.5))
            want = ffn_reference(w, x, neurons=w.perm[kept])
            assert np.abs(y - want).max() <= 2e-3 * np.abs(want).max() + 1e-5, isa
            xr = round_like_ggml(x[0], w.gate_type).astype(np.float64)
            h = np.abs(act(w.gate.astype(np.float64) @ xr, "silu") * (w.up.astype(np.float64) @ xr))[w.perm]
            rest = np.setdiff1d(np.arange(nb), kept)
            assert h[kept].min() >= h[rest].max() - 1e-3 * h.max()


def test_streamed_cascade_matches_reference(sketched, isa):
    """Under a budget (blocks streamed, the plain layout) the cascade's down pass adds the kept
    columns in place: the FFN over the kept blocks."""
    path, sketch = sketched
    w = load_layer(path)
    rng = np.random.default_rng(5)
    with FFNEngine([path], mode="leanstream", sketch_paths=[sketch], sparsity=0.5) as e0:
        info = e0.layer_info(0)
        budget = e0.stats()["resident_bytes"] + (info["n_blocks"] - 1) * info["block_stride"]
    with FFNEngine([path], mode="leanstream", sketch_paths=[sketch], sparsity=0.5, memory_budget=budget) as e:
        for _ in range(3):
            x = rng.standard_normal((1, N_EMBD)).astype(np.float32)
            y = e.eval_layer(0, x, n_threads=2, x_res=x)
            kept = e.last_plan(0)
            want = ffn_reference(w, x, neurons=w.perm[kept])
            assert np.abs(y - want).max() <= 2e-3 * np.abs(want).max() + 1e-5, isa
        assert e.layer_info(0)["split_layout"] == 0
