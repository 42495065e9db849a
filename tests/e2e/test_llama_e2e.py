"""End to end on SmolLM2-135M-Instruct: leanstream_ggml.Llama over the converted directory
against stock llama_cpp.Llama on the original GGUF (same process, same llama.cpp build; with
no FFN builder installed the patched build runs stock code paths).

Tolerance of the logit comparison (dense mode, full budget). Two llama.cpp runs that differ
only in rounding (f32 instead of f16 KV cache) agree on the top-1 token 0.968-0.973 of the
time with mean KL 0.002-0.004 (docs/design.md §9): an exact plugin lands there, not at 1.000. Ours
rounds differently from stock in one place of the same size as stock's own rounding: stock
quantizes h = silu(gate)*up to 8 bits before the down projection (0.4 % relative error on a
layer's output), we keep h in f32 but hold the transposed down columns in Q8_0 (0.3 %). We
assert top-1 agreement >= 0.90 and mean KL <= 0.02 over ~380 teacher-forced tokens (measured:
see test output, ~0.94 / ~0.008), which a wrong neuron, block, permutation or layer would miss
by far (a single corrupted layer drops agreement below 0.5).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
from logits import agreement_and_kl, teacher_forced
import pytest

import llama_cpp
from leanstream_ggml import Llama
from leanstream_ggml.native._native import LeanstreamError

pytestmark = pytest.mark.slow

CTX = dict(n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False)


@pytest.fixture(scope="module")
def stock(smollm2_gguf):
    llm = llama_cpp.Llama(str(smollm2_gguf), logits_all=True, **CTX)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def plugin(smollm2_dir):
    llm = Llama(str(smollm2_dir), logits_all=True, **CTX)
    yield llm
    llm.close()


def test_teacher_forced_logits_match_stock(stock, plugin, prose):
    tokens = stock.tokenize(prose.encode())
    assert plugin.tokenize(prose.encode()) == tokens
    a = teacher_forced(stock, tokens)
    b = teacher_forced(plugin, tokens)
    agree, kl = agreement_and_kl(a, b)
    print(f"\n{len(tokens)} tokens: max |logit diff| {np.abs(a - b).max():.3f}, top-1 agreement {agree:.4f}, "
          f"mean KL {kl.mean():.5f}, max KL {kl.max():.4f}")
    assert agree >= 0.90
    assert kl.mean() <= 0.02
    # every FFN of every position was computed by the op from our block files
    s = plugin.stats()
    assert s["op_calls"] >= 30 and s["blocks_computed"] > 0 and s["bytes_read"] > 0


def test_greedy_generation_follows_stock(stock, plugin):
    prompt = "The three most important ideas in operating systems are"
    out = plugin(prompt, max_tokens=64, temperature=0.0)["choices"][0]["text"]
    ref = stock(prompt, max_tokens=64, temperature=0.0)["choices"][0]["text"]
    gen = plugin.tokenize(out.encode(), add_bos=False)
    assert len(gen) >= 32
    # stock, teacher-forced on the plugin's continuation, picks the same next token almost everywhere
    ptoks = stock.tokenize(prompt.encode())
    a = teacher_forced(stock, ptoks + gen)
    picks = a[len(ptoks) - 1: len(ptoks) + len(gen) - 1].argmax(-1)
    agree = (picks == np.array(gen)).mean()
    common = os.path.commonprefix([out, ref])
    print(f"\nplugin: {out!r}\nstock:  {ref!r}\ncommon prefix {len(common)} chars; stock agrees with "
          f"{agree:.3f} of the plugin's greedy tokens")
    assert agree >= 0.90


def test_chat_template_streaming_and_tokenizer(plugin, stock):
    messages = [{"role": "user", "content": "Name a primary color."}]
    full = plugin.create_chat_completion(messages=messages, max_tokens=24, temperature=0.0, seed=1)
    text = full["choices"][0]["message"]["content"]
    chunks = plugin.create_chat_completion(messages=messages, max_tokens=24, temperature=0.0, seed=1, stream=True)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text.strip() and streamed == text  # the op is deterministic for a fixed thread count
    assert plugin.metadata.get("tokenizer.chat_template") == stock.metadata.get("tokenizer.chat_template")
    toks = plugin.tokenize(b"Hello, world!")
    assert toks == stock.tokenize(b"Hello, world!")
    assert plugin.detokenize(toks) == stock.detokenize(toks)


def test_two_models_in_one_process(tmp_path, plugin, stock, prose):
    """A second converted model (synthetic, different shape) alongside SmolLM2: both exact."""
    from leanstream_convert import convert
    from gguf_synth import write_tiny_model

    src = tmp_path / "tiny.gguf"
    write_tiny_model(src, arch="qwen2", n_layer=3, n_embd=64, n_ff=160, types={"ffn": "F16"}, seed=3)
    convert(src, tmp_path / "tiny.lsm", progress=False, sketch="none")
    tiny = Llama(str(tmp_path / "tiny.lsm"), logits_all=True, **CTX)
    tiny_stock = llama_cpp.Llama(str(src), logits_all=True, **CTX)
    try:
        toks = tiny_stock.tokenize(b"two models, one process")
        smol_toks = stock.tokenize(prose.encode())[:64]
        # interleave: smol, tiny, smol
        s1 = teacher_forced(plugin, smol_toks)
        t = teacher_forced(tiny, toks)
        s2 = teacher_forced(plugin, smol_toks)
        assert np.array_equal(s1, s2)
        # F16 FFN: the down columns stay F16, so the tiny model matches stock to rounding noise
        t_ref = teacher_forced(tiny_stock, toks)
        assert np.abs(t - t_ref).max() <= 1e-2 * np.abs(t_ref).max()
        assert (s1.argmax(-1) == teacher_forced(stock, smol_toks).argmax(-1)).mean() >= 0.9
    finally:
        tiny.close()
        tiny_stock.close()


def test_plain_gguf_is_refused_with_a_hint(smollm2_gguf):
    with pytest.raises(ValueError, match="leanstream convert"):
        Llama(str(smollm2_gguf))


def test_read_error_during_decode_raises_and_recovers(smollm2_dir, tmp_path):
    d = tmp_path / "copy.lsm"
    shutil.copytree(smollm2_dir, d)
    blk = d / "ffn" / "blk.7.bin"
    one_layer = blk.stat().st_size  # a budget of ~one layer: every token re-reads every layer
    llm = Llama(str(d), memory_budget=one_layer, **CTX)
    try:
        toks = llm.tokenize(b"Streaming weights from disk")
        llm.eval(toks)
        data = blk.read_bytes()
        os.truncate(blk, len(data) // 2)
        with pytest.raises(LeanstreamError, match=r"blk\.7\.bin.*offset"):
            llm.eval(llm.tokenize(b" again", add_bos=False))
        blk.write_bytes(data)
        llm.reset()
        llm.eval(toks)  # the next call works
        s = llm.stats()
        assert s["cache_bytes"] <= s["cache_capacity"] <= one_layer
    finally:
        llm.close()


def test_cli_chat_prompt_and_info(smollm2_dir):
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "chat", str(smollm2_dir), "--prompt",
                        "Say hello.", "-n", "16", "--temp", "0", "-t", "2"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "info", str(smollm2_dir)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "n_layer 30" in r.stdout


@pytest.fixture(scope="module")
def smollm2_random_pred_dir(smollm2_dir, tmp_path_factory):
    pytest.importorskip("torch", reason="predictor files are made with torch (convert extra)")
    from pred_synth import write_random_predictors

    d = tmp_path_factory.mktemp("smolpred") / "smollm2.lsm"
    shutil.copytree(smollm2_dir, d)
    write_random_predictors(d)
    return d


def test_sparse_plumbing_inside_llama_cpp(stock, smollm2_random_pred_dir, prose):
    """leanstream mode with every block selected (sparsity 0) by the predictors computes the same
    FFN as dense, with the next layer's prefetch running: agreement with stock
    stays at the dense level. With sparsity 0.5 under a budget, the engine streams and respects it."""
    d = smollm2_random_pred_dir
    tokens = stock.tokenize(prose.encode())[:96]
    ref = teacher_forced(stock, tokens)
    llm = Llama(str(d), mode="leanstream", sparsity=0.0, logits_all=True, **CTX)
    try:
        # decode one token at a time: every FFN op is a sparse-path (single-row) op
        llm.reset()
        for t in tokens:
            llm.eval([t])
        got = np.array(llm.scores[: len(tokens)], dtype=np.float64)
        s = llm.stats()
    finally:
        llm.close()
    agree = (ref.argmax(-1) == got.argmax(-1)).mean()
    print(f"\nleanstream s=0 decode-by-token vs stock: top-1 agreement {agree:.3f}; "
          f"{s['blocks_prefetched']} blocks prefetched")
    assert agree >= 0.90
    assert s["blocks_prefetched"] > 0

    budget = 24 << 20  # about a third of SmolLM2's FFN
    llm = Llama(str(d), mode="leanstream", sparsity=0.5, memory_budget=budget, **CTX)
    try:
        out = llm("Memory is the scarce resource", max_tokens=8, temperature=0.0)["choices"][0]["text"]
        s = llm.stats()
        assert s["cache_bytes"] <= s["cache_capacity"] <= budget
        # reads / computed: above 1 when prefetched blocks go unused (docs/design.md §5's definition)
        assert s["blocks_read"] > 0 and s["miss_ratio"] > 0
        assert isinstance(out, str)
    finally:
        llm.close()


def test_sparse_mode_without_predictors_is_refused(smollm2_dir):
    with pytest.raises(ValueError, match="predictors"):
        Llama(str(smollm2_dir), mode="leanstream")
