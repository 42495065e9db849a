"""The dense architectures llama.cpp runs beyond SmolLM2 (llama) and Qwen2.5 (qwen2): qwen3, phi3,
granite, olmo2, gemma2, gemma3 (here a synthetic one; gemma3-270m itself: test_gemma3.py, slow),
and llama-architecture models shipped otherwise (Llama 3.1 / 3.2: rope_freqs, tied output,
K-quants; Mistral Nemo: heads of another size than n_embd / n_head).

No real weights of these are in the package registry: each is a synthetic GGUF in its
architecture's real tensor layout and metadata (tests/support/gguf_synth.py), with weights scaled
so that next-token distributions are peaked and the FFN decides the next token (a model whose FFN
is replaced agrees with it on under half of the tokens). Each is converted as a user converts
(every default stage: write, activations, order, reorder, sketch) and decoded in dense mode against
stock llama-cpp-python on the same source, teacher-forced on the SmolLM2 test's prose, with that
test's bounds: top-1 agreement >= 0.90, mean KL <= 0.02 (tests/e2e/test_llama_e2e.py: stock
against itself with an f32 KV cache lands at 0.97 / 0.003; a wrong activation or layer misses by
far; phi3 with its gate and up halves swapped agrees 0.075). Measured (2 layers, n_embd 64, n_ff
96, Q4_0 FFN, 160 tokens; llama3: n_embd 256, Q4_K gate/up, Q6_K down), top-1 / mean KL:

    qwen3 0.975 / 0.0015   phi3 0.956 / 0.0019    granite 0.994 / 0.0019   olmo2 0.981 / 0.0006
    gemma2 0.994 / 0.0004  gemma3 0.981 / 0.0005  llama3 0.950 / 0.0031    mistral 0.963 / 0.0014

What each needed (leanstream_ggml/model/manifest.py ARCH_ACTIVATION, leanstream_convert/convert_gguf.py
FUSED_GATE_UP, leanstream_ggml/model/sparse_files.py DENSE_ONLY_ARCHS):
- qwen3, granite, olmo2, gemma2: an entry in the activation table. Their graphs name the residual
  entering the FFN (ffn_inp-<il>; gemma2 sa_out-<il>); olmo2 hands build_ffn that residual itself
  (it has no pre-norm), granite scales the FFN's output and olmo2 / gemma2 norm it again, all in
  llama.cpp's graph around the op.
- phi3: its fused ffn_up ([2 n_ff, n_embd], the gate rows first) is split into the gate and up
  halves by the read stage (views of the same bytes: one layer at a time as before). Its graph
  named no residual entering the FFN; patches/0006 names it ffn_inp-<il>, so the sparse modes run.
- llama variants: nothing (rope_freqs.weight and a missing output.weight are not FFN tensors).
- Speculative decoding: answers equal plain decoding's on every one, and the self draft runs on
  every one: patches/0004 hands the output projection to the op in build_lora_mm, which every
  graph's head goes through (output.weight, or token_embd.weight when tied).
"""

from __future__ import annotations

import gguf
import numpy as np
from logits import agreement_and_kl, teacher_forced
import pytest

import llama_cpp
from leanstream_convert import convert
from gguf_synth import write_tiny_model
from leanstream_ggml import Llama
from leanstream_ggml.model import manifest as mf
from reference import load_layer

CTX = dict(n_ctx=256, n_threads=2, n_threads_batch=2, verbose=False)
N_TOKENS = 160
PROMPT = "The three most important ideas in operating systems are"
# (prompt lookup drafts from the n-grams a context repeats: the second has some of its own; a
# random model may end its answer at once: three prompts)
SPEC_PROMPTS = [PROMPT, "the cat sat on the mat, the dog sat on the log, the cat sat on the", "Once upon a time"]

# case -> write_tiny_model's arguments (2 layers; n_embd 64, n_ff 96, Q4_0 FFN unless given)
CASES = {
    "qwen3": dict(arch="qwen3", head_dim=32),
    "phi3": dict(arch="phi3"),
    "granite": dict(arch="granite"),
    "olmo2": dict(arch="olmo2"),
    "gemma2": dict(arch="gemma2", head_dim=32),
    "gemma3": dict(arch="gemma3", head_dim=32),   # (gemma3-270m itself: tests/e2e/test_gemma3.py, slow)
    # Llama 3.1 / 3.2 as their Q4_K_M GGUFs ship: rope scaling factors, the output tied to the
    # embeddings, one K/V head per 4, Q4_K gate/up and Q6_K down
    "llama3": dict(arch="llama", n_embd=256, n_ff=256, n_head_kv=1, rope_freqs=True, tied_output=True,
                   types={"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}),
    # Mistral Nemo: 32 heads of 128 over n_embd 5120, here 4 heads of 32 over 64
    "mistral": dict(arch="llama", head_dim=32, n_head_kv=1),
}
# convert()'s arguments besides the defaults: llama3's down columns in Q8_0. The default for a Q6_K
# ffn_down at n_embd 256 is Q6_K columns, a second quantization (docs/design.md §11), which costs
# this random model's peaked distributions 0.919 / 0.0096 (Q8_0: 0.950 / 0.0031; stock against
# itself with an f32 KV cache 0.956 / 0.0019): nearer the bounds than the architecture under test
CONVERT = {"llama3": dict(down_type="q8_0")}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """converted(name) -> (name, source GGUF, the values it holds, converted directory, manifest),
    each case written and converted once."""
    done = {}

    def get(name):
        if name not in done:
            d = tmp_path_factory.mktemp(name)
            kw = dict(n_layer=2, n_embd=64, n_ff=96, seed=0, scales="peaked")
            kw.update(CASES[name])
            src = d / f"{name}.gguf"
            values = write_tiny_model(src, **kw)
            m = convert(src, d / "lsm", progress=False, **CONVERT.get(name, {}))   # every default stage
            done[name] = name, src, values, d / "lsm", m
        return done[name]

    return get


@pytest.fixture(params=list(CASES))
def case(request, converted):
    return converted(request.param)


@pytest.fixture(scope="module")
def prose_tokens(prose, tmp_path_factory):
    """Every case has the same vocabulary (gguf_synth.gpt2_vocab): one model tokenizes for all."""
    p = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    write_tiny_model(p, n_layer=1)
    stock = llama_cpp.Llama(str(p), **CTX)
    try:
        return stock.tokenize(prose.encode())[:N_TOKENS]
    finally:
        stock.close()


def test_dense_matches_stock(case, prose_tokens):
    name, src, _, out, m = case
    assert m.architecture == CASES[name]["arch"] and m.activation == mf.ARCH_ACTIVATION[m.architecture]
    stock = llama_cpp.Llama(str(src), logits_all=True, **CTX)
    try:
        a = teacher_forced(stock, prose_tokens)
    finally:
        stock.close()
    plugin = Llama(str(out), logits_all=True, in_ram="stream", **CTX)   # the op (Q4_0/Q4_K: stock.py would not)
    try:
        b = teacher_forced(plugin, prose_tokens)
        s = plugin.stats()
    finally:
        plugin.close()
    agree, kl = agreement_and_kl(a, b)
    top = np.exp(a - a.max(-1, keepdims=True))
    print(f"\n{name}: {len(prose_tokens)} tokens, mean top-1 probability {(1 / top.sum(-1)).mean():.3f}: "
          f"top-1 agreement {agree:.4f}, mean KL {kl.mean():.5f}, max KL {kl.max():.4f}")
    assert agree >= 0.90
    assert kl.mean() <= 0.02
    # every layer's FFN was the op's, from the block files
    assert s["op_calls"] >= m.n_layer and s["blocks_computed"] > 0 and s["bytes_read"] > 0


def test_phi3_block_files_hold_the_fused_halves(converted, prose_tokens):
    """phi3: each neuron's gate row is row i of the fused ffn_up, its up row row n_ff + i (the halves
    ggml_swiglu takes), byte for byte; the other way round the model is another one."""
    _, src, values, out, m = converted("phi3")
    ffn = [t for t in gguf.GGUFReader(src).tensors if ".ffn_" in t.name and "norm" not in t.name]
    assert sorted(t.name for t in ffn) == sorted(f"blk.{il}.ffn_{r}.weight" for il in range(2) for r in ("up", "down"))
    assert m.totals.ffn_bytes_source == sum(int(t.n_bytes) for t in ffn)
    assert not [t for t in gguf.GGUFReader(out / mf.BASE_NAME).tensors if ".ffn_up" in t.name or ".ffn_down" in t.name]
    for il in range(m.n_layer):
        w = load_layer(m.layer_path(out, il))
        fused = values[f"blk.{il}.ffn_up.weight"]               # [2 n_ff, n_embd]
        assert np.array_equal(w.gate, fused[: m.n_ff]) and np.array_equal(w.up, fused[m.n_ff:])
    # the test above would see the halves swapped: stock llama.cpp on such a file parts from it
    swapped = src.with_name("swapped.gguf")
    _write_swapped_halves(src, swapped)
    ra, rb = (llama_cpp.Llama(str(p), logits_all=True, **CTX) for p in (src, swapped))
    try:
        agree, kl = agreement_and_kl(teacher_forced(ra, prose_tokens), teacher_forced(rb, prose_tokens))
    finally:
        ra.close()
        rb.close()
    print(f"\nphi3 against its gate and up swapped: top-1 agreement {agree:.3f}, mean KL {kl.mean():.3f}")
    assert agree < 0.5


def _write_swapped_halves(src, dst) -> None:
    data = bytearray(src.read_bytes())
    for t in gguf.GGUFReader(src).tensors:
        if t.name.endswith("ffn_up.weight"):
            o, half = int(t.data_offset), int(t.n_bytes) // 2
            data[o:o + 2 * half] = data[o + half:o + 2 * half] + data[o:o + half]
    dst.write_bytes(bytes(data))


@pytest.mark.parametrize("kw", [dict(speculative="auto"), dict(speculative="self", draft_stop="fixed", draft_fraction=1.0),
                                dict(speculative="ngram", draft_stop="fixed")], ids=["auto", "self-fixed", "ngram-fixed"])
def test_speculative_greedy_equals_plain(case, kw):
    """Greedy answers with speculative decoding (the default, auto; the self draft and prompt lookup
    drafting whenever they have a proposal) equal plain decoding's, under a budget of half the FFN
    (the self draft is the resident half)."""
    name, _, _, out, m = case
    budget = m.totals.ffn_bytes_on_disk // 2
    got = {}
    for spec in (dict(speculative="off"), kw):
        llm = Llama(str(out), memory_budget=budget, seed=7, **spec, **CTX)
        try:
            got[spec["speculative"]] = [llm.create_completion(p, max_tokens=64, temperature=0)["choices"][0]["text"]
                                        for p in SPEC_PROMPTS]
            st = llm.stats().get("speculative")
        finally:
            llm.close()
    print(f"\n{name}, {kw}: {st['passes']} passes, {st['drafted']} drafted, {st['accepted']} accepted, "
          f"{st['draft_steps']} self-draft steps")
    assert got[kw["speculative"]] == got["off"] and any(got["off"])
    assert st["passes"] > 0 and st["drafted"] > 0        # drafts were verified
    if kw["speculative"] == "self":   # the self draft drafts and is right (patches/0004: every graph's head);
        assert st["draft_steps"] > 0 and st["accepted"] > 0   # (auto may stop drafting after a bad start)


def test_sparse_modes_run_on_every_architecture(case):
    """leanstream mode runs on every family: each graph hands the op the FFN's residual (phi3's
    through patches/0006)."""
    name, _, _, out, m = case
    ready, why = m.sparse_modes(out)
    assert "leanstream" in ready
    llm = Llama(str(out), mode="leanstream", sparsity=0.3, **CTX)
    try:
        text = llm.create_completion(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"]
        st = llm.stats()
    finally:
        llm.close()
    assert text and st["down_skipped"] > 0
