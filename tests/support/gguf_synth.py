"""Tiny synthetic GGUFs of the architectures leanstream converts, for tests, written with gguf-py.

    from gguf_synth import write_tiny_model     # from any test (tests/conftest.py puts tests/support/ on sys.path)
    w = write_tiny_model(tmp_path / "tiny.gguf", arch="llama", n_layer=2, n_embd=64, n_ff=96,
                         types={"ffn": "Q4_0"}, seed=0)
    w["blk.0.ffn_gate.weight"]      # float32 [n_ff, n_embd]: the values the file holds (dequantized)

Architectures (``ARCHS``), each in the tensor layout and with the metadata its llama.cpp graph
loads (src/models/<arch>.cpp, load_arch_tensors / load_arch_hparams):

    llama     attn_norm, q/k/v/output, ffn_norm, ffn_gate/up/down
    qwen2     llama + q/k/v biases
    qwen3     llama + attn_q_norm/attn_k_norm per head ([head_dim])
    phi3      fused attn_qkv; ffn_up fused: [2 n_ff, n_embd], the gate rows first, then the up rows
    granite   llama + granite.{embedding,residual,attention,logit}_scale (Granite 3's values)
    olmo2     no pre-norms; attn_q_norm/attn_k_norm over all heads, post_attention_norm, post_ffw_norm
    gemma2    llama + post_attention_norm, post_ffw_norm, output tied to token_embd, attention
              and final logit soft-capping, a sliding window
    gemma3    gemma2 + attn_q_norm/attn_k_norm per head, no soft-capping, a sliding window of 512

Mixture-of-experts layouts (``moe_experts=E`` experts of ``n_ff`` neurons each, ``moe_used``
routed per token, default min(2, E)), each as llama.cpp's loader and graph take it
(src/models/{qwen3moe,qwen2moe,olmoe,llama}.cpp: build_moe_ffn, softmax gating):

    qwen3moe  qwen3's attention; ffn_norm, ffn_gate_inp [E, n_embd] (F32, as llama-quantize
              leaves it), ffn_{gate,up,down}_exps [E, n_ff, n_embd] / [E, n_embd, n_ff];
              qwen3moe.expert_feed_forward_length; the chosen experts' weights normalized
    qwen2moe  qwen2's attention (biases); the routed experts as qwen3moe's, unnormalized, plus a
              shared expert ffn_{gate,up,down}_shexp of ``n_ff_shexp`` neurons (default n_ff) and
              its sigmoid gate ffn_gate_inp_shexp [n_embd]; expert_shared_feed_forward_length
    olmoe     attn_q_norm / attn_k_norm over the whole projection ([n_embd]; no grouped-query
              attention: n_head_kv is n_head), the routed experts unnormalized
    llama     with ``moe_experts``: Mixtral's layout (llama.expert_count; feed_forward_length is
              one expert's size), normalized
    qwen2     with ``moe_experts``: the same layout under "qwen2" (a converter case only: stock
              llama.cpp's qwen2 graph has no experts and does not load it)

The router's rows are normal with standard deviation ``scales["router"]`` (default 2 / sqrt(n_embd):
router logits of spread ~2 on the normed FFN input) times a factor per expert from 0.5 to 1.5, so
that routing is neither uniform nor always the same experts, and some experts are chosen more
often than others.

The files load in llama.cpp (checked with llama-cpp-python 0.3.36, the project's patched build:
each architecture loads, tokenizes and decodes; the files are plain GGUFs, nothing patch-specific;
tests/unit/test_converter.py::test_llama_cpp_loads_source_and_base and tests/e2e/test_archs.py
keep it so; for the MoE layouts tests/unit/test_moe_convert.py, which also checks that their
experts decide the next token and that routing spreads). Each carries a byte-level "gpt2" BPE vocabulary (256 byte tokens, a few merges and
the control tokens <|endoftext|>, <|im_start|>, <|im_end|>) and the hyperparameters llama.cpp
requires. Weights are random (a model that says nothing sensible, deterministically per seed):
normal with the standard deviation ``scales`` gives per role ("embd", "attn", "ffn", "output";
DEFAULT_SCALES otherwise). The defaults give next-token distributions close to uniform;
``scales="peaked"`` gives peaked ones (mean top-1 probability ~0.5, logits' spread ~4) in which
the FFN decides the next token (a model whose FFN is replaced agrees with it on under half of
the tokens): the tests that compare logits use it.

Types: ``types`` maps a role to a ggml type name (or gguf.GGMLQuantizationType):
"ffn" (gate, up, down together) or "gate" / "up" / "down" one at a time, each either a type or a
list with one type per layer (an MoE layer's experts and shared expert take them too); "attn" (q, k,
v, output), "embd" (token_embd), "output" (norms, biases and the router are F32).
Types gguf-py can quantize (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are quantized from random
normal weights; K-quants (Q2_K .. Q6_K) are random bytes with sane f16 super-block scales.
K-quants need rows that are multiples of 256 values (n_embd, and n_ff for ffn_down).

Variants for malformed-input tests: ``gated=False`` leaves out ffn_gate (a non-gated FFN);
``fused_gate_up_exps=True`` writes an MoE layer's gate and up experts as one ffn_gate_up_exps
(stock llama.cpp loads that only for a few families). ``alignment`` sets general.alignment
(tensor data alignment, default 32).
Variants of the llama architecture as other models ship it: ``tied_output=True`` writes no
output.weight (the output is token_embd: Llama 3.2 1B / 3B), ``rope_freqs=True`` a top-level
rope_freqs.weight (Llama 3.1's rope scaling factors, [head_dim / 2]), ``head_dim`` heads of
another size than n_embd / n_head (Mistral Nemo, Qwen 3, Gemma 2).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

DEFAULT_TYPES = {"ffn": "Q4_0", "attn": "F16", "embd": "F16", "output": "F16"}
# the standard deviation of each role's random weights; "post_norm": the value of every weight of
# the post-norms (olmo2, gemma2, gemma3), i.e. the size of what the attention and the FFN add to
# the residual
DEFAULT_SCALES = {"embd": 0.5, "attn": 0.05, "ffn": 0.05, "output": 0.05, "post_norm": 1.0}
# (and "router": the MoE router's rows, 2 / sqrt(n_embd) unless given)
# scales="peaked": the largest logit some units above the rest, the FFN's output as large as the
# residual stream's (a wrong FFN shows in the logits); granite divides its logits by 8, multiplies
# the embeddings by 12 and the FFN's output by 0.22; gemma's output matrix is its (tied) embedding,
# whose token would otherwise outweigh what the layers add to the residual
PEAKED = {"ffn": 0.15, "output": 0.6, "post_norm": 4.0}
PEAKED_ARCH = {"granite": {"embd": 0.05, "ffn": 0.25, "output": 4.8}, "gemma2": {"post_norm": 12.0},
               "gemma3": {"post_norm": 12.0}}

ARCHS = ("llama", "qwen2", "qwen3", "phi3", "granite", "olmo2", "gemma2", "gemma3", "qwen2moe", "qwen3moe", "olmoe")
MOE_ARCHS = ("qwen2moe", "qwen3moe", "olmoe")          # (llama and qwen2 take moe_experts too: Mixtral's layout)
# granite's multipliers as Granite 3 ships them (granite.*; llama.cpp's granite graph applies them)
GRANITE_SCALES = {"embedding_scale": 12.0, "residual_scale": 0.22, "logit_scale": 8.0}

# byte offsets of the f16 scale fields inside one K-quant block (ggml-common.h block_qN_K)
_K_F16_FIELDS = {
    T.Q2_K: (80, 82),      # scales[16], qs[64], d, dmin
    T.Q3_K: (108,),        # hmask[32], qs[64], scales[12], d
    T.Q4_K: (0, 2),        # d, dmin, scales[12], qs[128]
    T.Q5_K: (0, 2),        # d, dmin, scales[12], qh[32], qs[128]
    T.Q6_K: (208,),        # ql[128], qh[64], scales[16] (int8), d
}


def _qtype(t) -> T:
    return t if isinstance(t, T) else T[str(t).upper()]


def gpt2_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges) of a tiny byte-level BPE vocabulary."""
    # GPT-2's bytes_to_unicode: every byte as a printable character
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_tok = dict(zip(bs, (chr(c) for c in cs)))
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [3, 3, 3]                                  # LLAMA_TOKEN_TYPE_CONTROL
    tokens += [byte_tok[b] for b in range(256)]
    types += [1] * 256                                 # NORMAL
    merges = ["Ġ t", "h e", "i n", "e r", "Ġ a", "o n", "Ġt he", "r e"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
        types.append(1)
    return tokens, types, merges


def tiny_writer(path, arch: str, *, n_ctx: int, n_embd: int, block_count: int) -> gguf.GGUFWriter:
    """A GGUFWriter of a tiny model of ``arch``: its type, name, context, width and depth set."""
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_type("model")
    w.add_name(f"tiny-{arch}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(block_count)
    return w


def add_vocab(w: gguf.GGUFWriter, chat_template: bool = True) -> int:
    """gpt2_vocab() as a "gpt2" BPE tokenizer of w (byte tokens, merges, <|endoftext|> as BOS and EOS,
    no BOS added) and a ChatML template; returns n_vocab."""
    tokens, token_types, merges = gpt2_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return len(tokens)


def _weights(rng: np.random.Generator, qtype: T, rows: int, cols: int, scale: float):
    """(stored array for GGUFWriter.add_tensor, float32 [rows, cols] values it holds)."""
    if qtype in _K_F16_FIELDS:
        bs, ts = gguf.GGML_QUANT_SIZES[qtype]
        if cols % bs:
            raise ValueError(f"{qtype.name} needs rows of a multiple of {bs} values, got {cols}")
        raw = rng.integers(0, 256, size=(rows * cols // bs, ts), dtype=np.uint8)
        for off in _K_F16_FIELDS[qtype]:
            d = (rng.uniform(0.5, 1.0, size=len(raw)) * scale / 8).astype(np.float16)
            raw[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
        raw = raw.reshape(rows, -1)
        return raw, gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    if qtype == T.F32:
        return w, w
    if qtype == T.F16:
        w16 = w.astype(np.float16)
        return w16, w16.astype(np.float32)
    q = gguf.quants.quantize(w, qtype)
    return q, gguf.quants.dequantize(q, qtype).reshape(rows, cols)


def write_tiny_model(path: str | os.PathLike, arch: str = "llama", n_layer: int = 2, n_embd: int = 64,
                     n_ff: int = 96, types: dict[str, Any] | None = None, seed: int = 0, *,
                     n_head: int = 4, n_head_kv: int = 2, head_dim: int | None = None, n_ctx: int = 256,
                     moe_experts: int = 0, moe_used: int | None = None, n_ff_shexp: int | None = None,
                     fused_gate_up_exps: bool = False, gated: bool = True, extra_kv: dict[str, Any] | None = None,
                     alignment: int | None = None, scales: dict[str, float] | str | None = None,
                     tied_output: bool = False, rope_freqs: bool = False) -> dict[str, np.ndarray]:
    """Write a tiny random model GGUF at ``path``; returns {tensor name: float32 values as stored},
    each shaped [ne1, ne0] (numpy order: rows, row length) or [ne0] for vectors, an expert tensor
    [n_expert, ne1, ne0]. ``head_dim``: the attention heads' size (default n_embd // n_head; qwen3
    and gemma2 models often differ)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    if arch in MOE_ARCHS and not moe_experts:
        raise ValueError(f"{arch} needs moe_experts")
    if moe_experts and arch not in MOE_ARCHS + ("llama", "qwen2"):
        raise ValueError(f"moe_experts: {arch} has no mixture-of-experts layout here")
    moe_used = min(2, moe_experts) if moe_used is None else moe_used
    if moe_experts and not 0 < moe_used <= moe_experts:
        raise ValueError(f"moe_used must be in 1..{moe_experts}, got {moe_used}")
    if arch == "olmoe":
        n_head_kv = n_head     # its k norm has n_embd weights: one per value of every head
    if arch == "qwen2moe":
        n_ff_shexp = n_ff_shexp or n_ff
    ty = dict(DEFAULT_TYPES)
    ty.update(types or {})
    for role in ("gate", "up", "down"):
        ty.setdefault(role, ty["ffn"])
    layout = {"qwen2moe": "qwen2", "qwen3moe": "qwen3"}.get(arch, arch)    # the attention's layout
    sc = dict(DEFAULT_SCALES)
    if scales == "peaked":
        sc.update({**PEAKED, **PEAKED_ARCH.get(layout, {})})
        for role in ("ffn", "output"):      # (PEAKED's are for n_embd 64: a dot product grows as its root)
            sc[role] *= (64 / n_embd) ** 0.5
        if tied_output:                     # the embeddings are the output matrix
            sc["embd"] = sc["output"]
    else:
        sc.update(scales or {})
    sc.setdefault("router", 2.0 / n_embd ** 0.5)

    def ffn_type(role: str, il: int) -> T:
        t = ty[role]
        return _qtype(t[il] if isinstance(t, (list, tuple)) else t)

    rng = np.random.default_rng(seed)
    n_vocab = len(gpt2_vocab()[0])
    head_dim = head_dim or n_embd // n_head
    n_q, n_kv = n_head * head_dim, n_head_kv * head_dim      # rows of the q and of the k / v projections

    w = gguf.GGUFWriter(os.fspath(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)   # general.alignment; tensor data aligned to it
    w.add_type("model")
    # (llama.cpp gives a model named phi-3 / phi3 the attributes of phi-3's own tokens, which this
    # vocabulary has not: llama-vocab.cpp)
    w.add_name("tiny" if layout == "phi3" else f"tiny-{arch}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    if head_dim != n_embd // n_head:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(n_vocab)
    w.add_file_type(1)  # mostly F16; informational
    if moe_experts:
        w.add_expert_count(moe_experts)
        w.add_expert_used_count(moe_used)
        if arch in ("qwen2moe", "qwen3moe"):      # (olmoe and Mixtral: feed_forward_length is an expert's)
            w.add_expert_feed_forward_length(n_ff)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(n_ff_shexp)
    if layout == "granite":
        w.add_embedding_scale(GRANITE_SCALES["embedding_scale"])
        w.add_residual_scale(GRANITE_SCALES["residual_scale"])
        w.add_attention_scale(1.0 / head_dim)
        w.add_logit_scale(GRANITE_SCALES["logit_scale"])
    if layout == "gemma2":
        w.add_sliding_window(4096)
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if layout == "gemma3":
        w.add_sliding_window(512)
    add_vocab(w)
    for key, val in (extra_kv or {}).items():
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        else:
            w.add_string(key, str(val))

    out: dict[str, np.ndarray] = {}

    def add(name: str, qtype, rows: int, cols: int, scale: float) -> None:
        stored, values = _weights(rng, _qtype(qtype), rows, cols, scale)
        w.add_tensor(name, stored, raw_dtype=_qtype(qtype))
        out[name] = values

    def add_vec(name: str, n: int, value: float | None = None, std: float = 0.02) -> None:
        v = np.full(n, value, np.float32) if value is not None else (rng.standard_normal(n) * std).astype(np.float32)
        w.add_tensor(name, v)
        out[name] = v

    def add_experts(name: str, qtype: T, rows: int, cols: int) -> None:
        """[moe_experts, rows, cols]: one matrix per expert, expert e's bytes the e-th slice."""
        stored, values = _weights(rng, qtype, moe_experts * rows, cols, sc["ffn"])
        w.add_tensor(name, stored.reshape(moe_experts, rows, -1), raw_dtype=qtype)
        out[name] = values.reshape(moe_experts, rows, cols)

    def add_moe(p: str, il: int) -> None:
        spread = np.linspace(0.5, 1.5, moe_experts, dtype=np.float32)[rng.permutation(moe_experts)]
        router = (rng.standard_normal((moe_experts, n_embd)) * sc["router"]).astype(np.float32) * spread[:, None]
        w.add_tensor(p + "ffn_gate_inp.weight", router)        # F32, as llama-quantize leaves it
        out[p + "ffn_gate_inp.weight"] = router
        if fused_gate_up_exps:
            add_experts(p + "ffn_gate_up_exps.weight", ffn_type("gate", il), 2 * n_ff, n_embd)
        else:
            add_experts(p + "ffn_gate_exps.weight", ffn_type("gate", il), n_ff, n_embd)
            add_experts(p + "ffn_up_exps.weight", ffn_type("up", il), n_ff, n_embd)
        add_experts(p + "ffn_down_exps.weight", ffn_type("down", il), n_embd, n_ff)
        if arch == "qwen2moe":      # the shared expert and its gate (sigmoid of one dot product)
            add_vec(p + "ffn_gate_inp_shexp.weight", n_embd, std=sc["router"])
            add(p + "ffn_gate_shexp.weight", ffn_type("gate", il), n_ff_shexp, n_embd, sc["ffn"])
            add(p + "ffn_up_shexp.weight", ffn_type("up", il), n_ff_shexp, n_embd, sc["ffn"])
            add(p + "ffn_down_shexp.weight", ffn_type("down", il), n_embd, n_ff_shexp, sc["ffn"])

    post_norms = layout in ("olmo2", "gemma2", "gemma3")   # norms of the attention's and the FFN's outputs
    pre_norms = layout != "olmo2"                    # olmo2 feeds the residual stream itself
    add("token_embd.weight", ty["embd"], n_vocab, n_embd, sc["embd"])
    if rope_freqs:   # a factor per rotated pair, 1 (high frequencies) to 8 (low) as Llama 3.1's
        f = np.linspace(1.0, 8.0, head_dim // 2, dtype=np.float32)
        w.add_tensor("rope_freqs.weight", f)
        out["rope_freqs.weight"] = f
    for il in range(n_layer):
        p = f"blk.{il}."
        if pre_norms:
            add_vec(p + "attn_norm.weight", n_embd, 1.0)
        if layout == "phi3":
            add(p + "attn_qkv.weight", ty["attn"], n_q + 2 * n_kv, n_embd, sc["attn"])
        else:
            add(p + "attn_q.weight", ty["attn"], n_q, n_embd, sc["attn"])
            add(p + "attn_k.weight", ty["attn"], n_kv, n_embd, sc["attn"])
            add(p + "attn_v.weight", ty["attn"], n_kv, n_embd, sc["attn"])
        if layout == "qwen2":
            add_vec(p + "attn_q.bias", n_q)
            add_vec(p + "attn_k.bias", n_kv)
            add_vec(p + "attn_v.bias", n_kv)
        add(p + "attn_output.weight", ty["attn"], n_embd, n_q, sc["attn"])
        if layout in ("qwen3", "gemma3", "olmo2", "olmoe"):   # each head's q / k normed; olmo2 / olmoe: all heads
            whole = layout in ("olmo2", "olmoe")
            add_vec(p + "attn_q_norm.weight", n_q if whole else head_dim, 1.0)
            add_vec(p + "attn_k_norm.weight", n_kv if whole else head_dim, 1.0)
        if post_norms:
            add_vec(p + "post_attention_norm.weight", n_embd, sc["post_norm"])
        if pre_norms:
            add_vec(p + "ffn_norm.weight", n_embd, 1.0)
        if moe_experts:
            add_moe(p, il)
            continue
        if layout == "phi3":   # one matrix: gate rows, then up rows (ggml_swiglu's halves)
            add(p + "ffn_up.weight", ffn_type("up", il), 2 * n_ff, n_embd, sc["ffn"])
        else:
            if gated:
                add(p + "ffn_gate.weight", ffn_type("gate", il), n_ff, n_embd, sc["ffn"])
            add(p + "ffn_up.weight", ffn_type("up", il), n_ff, n_embd, sc["ffn"])
        add(p + "ffn_down.weight", ffn_type("down", il), n_embd, n_ff, sc["ffn"])
        if post_norms:
            add_vec(p + "post_ffw_norm.weight", n_embd, sc["post_norm"])
    add_vec("output_norm.weight", n_embd, 1.0)
    if layout not in ("gemma2", "gemma3") and not tied_output:      # gemma's output is token_embd
        add("output.weight", ty["output"], n_vocab, n_embd, sc["output"])

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
