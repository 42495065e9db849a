"""Gemma 3 (gemma3 architecture, GELU-gated FFN: down(gelu_tanh(gate x) * up x)).

The activation is one more entry of the op's activation table (LS_ACT_GELU). ggml's CPU geglu
does not evaluate GELU directly: it looks it up in a table indexed by the input rounded to f16
whose entries are rounded to f16 (0 below -10, the identity above 10); the op and the numpy
reference do the same, so the op is checked against the reference with test_op.py's bound.

End to end on gemma3-270m Q4_K_M (from the package registry), dense mode against stock
llama-cpp-python on the original GGUF, teacher-forced on the same prose as the SmolLM2 test.
Noise floor, measured on this model and text: stock against itself with an f32 instead of an f16
KV cache agrees on the top-1 token 0.950 of the time with mean KL 0.0071; the plugin in dense mode
measured 0.966 / 0.0072 (gate/up keep their Q5_0 bytes and go through ggml's own kernels; down
columns are Q8_0, as for the SiLU models). We assert the SmolLM2 test's bounds, agreement >= 0.90
and mean KL <= 0.02: a wrong activation (SiLU in place of GELU measured 0.573 / 1.00) or a
wrong layer would miss them by far.

Sparse modes: not for gemma3 yet. The op can find the FFN's residual input in gemma3's graph, but
the predictor stage profiles llama/qwen2 graph tensors only, so the converter writes no predictors
for gemma3 and the model runs dense.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from logits import agreement_and_kl, teacher_forced
import pytest

from leanstream_convert import convert
from gguf_synth import write_tiny_model
from leanstream_ggml.native.engine import FFNEngine
from reference import act, ffn_reference, load_layer


def test_gelu_reference_follows_ggmls_f16_table():
    z = np.array([-12.0, -10.0, -9.99, -1.0, -1e-3, 0.0, 0.3, 1.0, 2.5, 9.99, 10.0, 30.0])
    y = act(z, "gelu")
    assert y[0] == 0.0 and y[1] == 0.0 and y[-1] == 30.0 and y[-2] == 10.0
    exact = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    inside = (z > -10) & (z < 10)
    assert np.allclose(y[inside], exact[inside], rtol=2e-3, atol=1e-3)
    # every value inside is an f16 number
    assert np.array_equal(y[inside], y[inside].astype(np.float16).astype(np.float64))


@pytest.mark.parametrize("types", [{"ffn": "F16"}, {"gate": "Q5_0", "up": "Q5_0", "down": "Q6_K"}],
                         ids=["f16", "gemma3-types"])
@pytest.mark.parametrize("n_tokens", [1, 5])
def test_gelu_op_matches_reference(tmp_path, types, n_tokens):
    src = tmp_path / "tiny.gguf"
    write_tiny_model(src, arch="llama", n_layer=2, n_embd=256, n_ff=512, types=types, seed=4)
    m = convert(src, tmp_path / "lsm", progress=False, sketch="none")
    paths = [m.layer_path(tmp_path / "lsm", il) for il in range(2)]
    x = np.random.default_rng(1).standard_normal((n_tokens, 256)).astype(np.float32) * 3
    with FFNEngine(paths, activation="gelu") as e, FFNEngine(paths, activation="silu") as e_silu:
        for il in range(2):
            w = load_layer(paths[il])
            y = e.eval_layer(il, x, n_threads=2)
            ref = ffn_reference(w, x, activation="gelu")
            err = np.abs(y - ref).max()
            assert err <= 1e-3 * np.abs(ref).max() + 1e-5, f"max err {err}"
            # the activation matters: SiLU on the same weights is far off
            assert np.abs(e_silu.eval_layer(il, x, n_threads=2) - ref).max() > 0.05 * np.abs(ref).max()


# ---- the real model ------------------------------------------------------------------------

CTX = dict(n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False)


@pytest.fixture(scope="module")
def gemma3_gguf():
    from leanstream_ggml.model import registry

    return registry.fetch("gemma3-270m", progress=False)


@pytest.fixture(scope="module")
def gemma3_dir(gemma3_gguf, tmp_path_factory):
    """Converted by name through the CLI, as a user would (`leanstream convert gemma3-270m`)."""
    out = tmp_path_factory.mktemp("gemma3") / "gemma3.lsm"
    r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "convert", "gemma3-270m", str(out), "--quiet"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "ls2 sketch" in r.stdout and "leanstream mode ready" in r.stdout, r.stdout
    return out


@pytest.mark.slow
def test_gemma3_converts_with_gelu_and_says_dense_only(gemma3_dir):
    from leanstream_ggml.model import manifest

    import numpy as np

    m = manifest.load(gemma3_dir)
    assert m.architecture == "gemma3" and m.activation == "gelu" and m.predictor is None
    assert m.sketch is not None and m.sketch.quality == []   # the quality= calibration is opt-in (--calibrate)
    # the activations pass captured gemma3's GELU-gated product inside the op: neurons placed by
    # importance and the hot set ranked by the calibration text's block frequencies
    assert m.sketch.block_freq is not None
    freq = np.load(gemma3_dir / m.sketch.block_freq)
    assert freq.shape[0] == m.n_layer and freq.min() >= 0 and freq.max() <= 1 and freq.std() > 0
    from leanstream_convert import blockfile

    for e in m.layers:
        path = gemma3_dir / e.file
        h = blockfile.read_header(path)
        with open(path, "rb") as f:
            f.seek(h.perm_offset)
            perm = np.frombuffer(f.read(4 * h.n_blocks * h.k), dtype="<i4")
        assert not np.array_equal(perm[perm >= 0], np.arange(m.n_ff)), f"layer {e.il} kept GGUF order"
    r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "info", str(gemma3_dir)],
                       capture_output=True, text=True, timeout=60)
    assert "activation gelu" in r.stdout
    assert "ready: leanstream" in r.stdout and "needs predictors" in r.stdout


@pytest.mark.slow
def test_gemma3_dense_matches_stock(gemma3_gguf, gemma3_dir, prose):
    import llama_cpp

    from leanstream_ggml import Llama

    stock = llama_cpp.Llama(str(gemma3_gguf), logits_all=True, **CTX)
    try:
        tokens = stock.tokenize(prose.encode())
        a = teacher_forced(stock, tokens)
        ref_text = stock("The three most important ideas in operating systems are", max_tokens=24,
                         temperature=0.0)["choices"][0]["text"]
    finally:
        stock.close()
    plugin = Llama(str(gemma3_dir), logits_all=True, **CTX)
    try:
        assert plugin.tokenize(prose.encode()) == tokens
        b = teacher_forced(plugin, tokens)
        s = plugin.stats()
        text = plugin("The three most important ideas in operating systems are", max_tokens=24,
                      temperature=0.0)["choices"][0]["text"]
    finally:
        plugin.close()
    agree, kl = agreement_and_kl(a, b)
    print(f"\ngemma3-270m, {len(tokens)} tokens: top-1 agreement {agree:.4f}, mean KL {kl.mean():.5f}, "
          f"max KL {kl.max():.4f}\nplugin: {text!r}\nstock:  {ref_text!r}")
    assert agree >= 0.90
    assert kl.mean() <= 0.02
    assert s["op_calls"] >= 18 and s["blocks_computed"] > 0 and s["bytes_read"] > 0
    assert text.strip()


@pytest.mark.slow
def test_gemma3_sparse_modes(gemma3_dir):
    """leanstream runs on Gemma 3 with the sketch (selection from the layer's own input: GELU
    scored like SiLU); the baselines need predictors, which gemma3 has none of, and say so."""
    from leanstream_ggml import Llama

    llm = Llama(str(gemma3_dir), mode="leanstream", sparsity=0.3, **CTX)
    try:
        out = llm("The three most important ideas in operating systems are", max_tokens=8, temperature=0.0)
        st = llm.stats()
    finally:
        llm.close()
    assert out["choices"][0]["text"] and st["blocks_candidates"] > 0 and st["down_skipped"] > 0
    with pytest.raises(ValueError, match="predictors"):
        Llama(str(gemma3_dir), mode="dejavu+", **CTX)
