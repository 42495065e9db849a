"""Every quantization a llama.cpp CPU user downloads: BF16 (the usual unquantized file), Q3_K_M and
Q2_K (what is picked when memory is short), IQ4_XS (an i-quant), each made from the model by
llama.cpp's own quantizer (leanstream_tools/quants.py, re-quantized from the registry's file).

Gate and up rows keep the source's bytes and type; the op dots every type ggml's CPU backend dots
through ggml's type traits (the library's own kernels for Q4_K / Q4_1), and down is dequantized by
gguf-py and re-encoded (Q6_K columns from K- and i-quants, Q8_0 from BF16). Each file converts with
the default CLI (sketch included) and, with the FFN streamed (a budget of half of it), matches
stock llama-cpp-python on the same file teacher-forced on the prose (top-1 >= 0.95, mean KL <= 0.01,
or within stock's own noise where stock against itself is below that: the first test's docstring);
greedy answers with speculation (auto: the self draft) equal plain decoding's.

SmolLM2 (n_embd 576, not a multiple of 256) gets its gate/up rows in IQ4_NL from llama.cpp's
quantizer for Q3_K_M, Q2_K and IQ4_XS (its fallback for rows the K- and i-quants of 256 cannot
cut), its down rows in Q3_K / Q2_K / IQ4_XS; ``LEANSTREAM_QUANT_MODEL=qwen2.5-coder-1.5b-instruct``
runs the same tests on Qwen2.5-Coder-1.5B (n_embd 1536), whose gate/up hold Q3_K, Q2_K and IQ4_XS
themselves (bench/results/quant-types-*.json: both models' figures).

The same tests run Qwen2.5-Coder-0.5B-Instruct as the registry ships it (a second real qwen2, of
other types: gate/up Q5_0, down Q6_K or Q4_K by layer, an untied Q8_0 output), converted by name.
"""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import pytest
from logits import agreement_and_kl, teacher_forced

from leanstream_ggml import Llama
from leanstream_ggml.model import manifest

MODEL = os.environ.get("LEANSTREAM_QUANT_MODEL", "smollm2-135m-instruct")
QWEN05 = "qwen2.5-coder-0.5b-instruct"
# (model, the type llama.cpp's quantizer makes of it; None: the file as the registry ships it)
CASES = [(MODEL, t) for t in ("BF16", "Q3_K_M", "Q2_K", "IQ4_XS")] + [(QWEN05, None)]
CTX = dict(n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False)
PROMPTS = ("The three most important ideas in operating systems are", "def fibonacci(n):\n")

pytestmark = pytest.mark.slow   # (downloads a real model)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0].split('-')[0]}-{c[1] or 'shipped'}")
def converted(request, tmp_path_factory):
    """(its name, the GGUF, its directory converted by the default CLI: by path, or by name as shipped)."""
    from leanstream_ggml.model import registry
    from leanstream_tools import quants

    model, qtype = request.param
    src = registry.fetch(model, progress=False)
    src = quants.requantize(src, qtype) if qtype else src
    out = tmp_path_factory.mktemp(qtype or "shipped") / "m.lsm"
    r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "convert", str(src) if qtype else model,
                        str(out), "--quiet"], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    return f"{model} {qtype or 'as shipped'}", src, out


def _ffn_types(src) -> set[str]:
    return {t.tensor_type.name for t in gguf.GGUFReader(src).tensors if ".ffn_" in t.name and "norm" not in t.name}


def test_streamed_matches_stock_on_the_same_file(converted, prose):
    """top-1 >= 0.95 and mean KL <= 0.01 against stock on the same file; where stock against itself
    (an f32 KV cache, measured here) is below that, within its noise: top-1 at most 0.03 below
    stock's own, mean KL at most twice stock's own (SmolLM2's 3- and 4-bit files: stock against
    itself 0.93-0.95 / 0.006-0.0075)."""
    import llama_cpp

    name, src, out = converted
    m = manifest.load(out)
    logits = {}
    for kv in ("f16", "f32"):
        stock = llama_cpp.Llama(str(src), logits_all=True, **({"type_k": 0, "type_v": 0} if kv == "f32" else {}), **CTX)
        try:
            tokens = stock.tokenize(prose.encode())
            logits[kv] = teacher_forced(stock, tokens)
        finally:
            stock.close()
    floor_agree, floor_kl = agreement_and_kl(logits["f16"], logits["f32"])
    budget = m.totals.ffn_bytes_on_disk // 2
    plugin = Llama(str(out), logits_all=True, memory_budget=budget, speculative="off", **CTX)
    try:
        b = teacher_forced(plugin, tokens)
        st = plugin.stats()
    finally:
        plugin.close()
    agree, kl = agreement_and_kl(logits["f16"], b)
    print(f"\n{name} (FFN {sorted(_ffn_types(src))}; gate {m.layers[0].gate_type}, down columns "
          f"{m.layers[0].down_type}), streamed at {budget / 1e6:.0f} MB of {m.totals.ffn_bytes_on_disk / 1e6:.0f}: "
          f"{len(tokens)} tokens, top-1 {agree:.4f}, mean KL {kl.mean():.5f}, max KL {kl.max():.4f}; "
          f"stock against itself (f32 KV) {floor_agree:.4f} / {floor_kl.mean():.5f}")
    assert st["bytes_read"] > 0            # the FFN streamed
    assert agree >= min(0.95, floor_agree - 0.03) and kl.mean() <= max(0.01, 2 * floor_kl.mean())


def test_speculation_equals_plain_decoding(converted):
    name, src, out = converted
    m = manifest.load(out)
    got, st = {}, None
    for spec in ("off", "auto"):
        llm = Llama(str(out), memory_budget=m.totals.ffn_bytes_on_disk // 2, speculative=spec, **CTX)
        try:
            got[spec] = [llm.create_completion(p, max_tokens=48, temperature=0)["choices"][0]["text"] for p in PROMPTS]
            st = llm.stats().get("speculative")
        finally:
            llm.close()
    print(f"\n{name}: {st['passes']} passes, {st['drafted']} drafted, {st['accepted']} accepted, "
          f"{st['draft_steps']} self-draft steps")
    assert got["auto"] == got["off"] and all(got["off"])
    assert st["draft_steps"] > 0           # the self draft ran on this type's rows


def test_leanstream_mode_runs_on_every_type(converted):
    """The sketch is made from the dequantized rows, so sparse decode takes every type too."""
    name, src, out = converted
    llm = Llama(str(out), mode="leanstream", sparsity=0.3, **CTX)
    try:
        text = llm.create_completion(PROMPTS[0], max_tokens=8, temperature=0)["choices"][0]["text"]
        st = llm.stats()
    finally:
        llm.close()
    assert text and st["blocks_candidates"] > 0 and st["down_skipped"] > 0
