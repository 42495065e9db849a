"""Tiny synthetic llama / qwen2 GGUFs for tests, written with gguf-py.

    from gguf_synth import write_tiny_model     # from any test (tests/conftest.py puts tests/support/ on sys.path)
    w = write_tiny_model(tmp_path / "tiny.gguf", arch="llama", n_layer=2, n_embd=64, n_ff=96,
                         types={"ffn": "Q4_0"}, seed=0)
    w["blk.0.ffn_gate.weight"]      # float32 [n_ff, n_embd]: the values the file holds (dequantized)

The files load in llama.cpp (checked with llama-cpp-python 0.3.36, the project's patched build:
llama and qwen2 load, tokenize and decode; the files are plain GGUFs, nothing patch-specific;
tests/unit/test_converter.py::test_llama_cpp_loads_source_and_base keeps it so). Each carries a
byte-level "gpt2" BPE vocabulary (256 byte tokens, a few merges and
the control tokens <|endoftext|>, <|im_start|>, <|im_end|>) and the hyperparameters llama.cpp
requires. Weights are random (a model that says nothing sensible, deterministically per seed).

Types: ``types`` maps a role to a ggml type name (or gguf.GGMLQuantizationType):
"ffn" (gate, up, down together) or "gate" / "up" / "down" one at a time, each either a type or a
list with one type per layer; "attn" (q, k, v, output), "embd" (token_embd), "output" (norms and biases are F32).
Types gguf-py can quantize (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are quantized from random
normal weights; K-quants (Q2_K .. Q6_K) are random bytes with sane f16 super-block scales.
K-quants need rows that are multiples of 256 values (n_embd, and n_ff for ffn_down).

Variants for malformed-input tests: ``moe_experts=E`` writes a mixture-of-experts FFN
(ffn_gate_inp, ffn_{gate,up,down}_exps) instead of the dense one; ``gated=False`` leaves out
ffn_gate. ``alignment`` sets general.alignment (tensor data alignment, default 32).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

DEFAULT_TYPES = {"ffn": "Q4_0", "attn": "F16", "embd": "F16", "output": "F16"}

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
                     n_head: int = 4, n_head_kv: int = 2, n_ctx: int = 256, moe_experts: int = 0,
                     gated: bool = True, extra_kv: dict[str, Any] | None = None,
                     alignment: int | None = None) -> dict[str, np.ndarray]:
    """Write a tiny random model GGUF at ``path``; returns {tensor name: float32 values as stored},
    each shaped [ne1, ne0] (numpy order: rows, row length) or [ne0] for vectors."""
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch must be llama or qwen2, got {arch!r}")
    ty = dict(DEFAULT_TYPES)
    ty.update(types or {})
    for role in ("gate", "up", "down"):
        ty.setdefault(role, ty["ffn"])

    def ffn_type(role: str, il: int) -> T:
        t = ty[role]
        return _qtype(t[il] if isinstance(t, (list, tuple)) else t)

    rng = np.random.default_rng(seed)
    tokens, token_types, merges = gpt2_vocab()
    n_vocab = len(tokens)
    head_dim = n_embd // n_head

    w = gguf.GGUFWriter(os.fspath(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)   # general.alignment; tensor data aligned to it
    w.add_type("model")
    w.add_name(f"tiny-{arch}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(n_vocab)
    w.add_file_type(1)  # mostly F16; informational
    if moe_experts:
        w.add_expert_count(moe_experts)
        w.add_expert_used_count(min(2, moe_experts))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
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

    def add(name: str, qtype, rows: int, cols: int, scale: float = 0.05) -> None:
        stored, values = _weights(rng, _qtype(qtype), rows, cols, scale)
        w.add_tensor(name, stored, raw_dtype=_qtype(qtype))
        out[name] = values

    def add_vec(name: str, n: int, value: float | None = None) -> None:
        v = np.ones(n, np.float32) if value is not None else (rng.standard_normal(n) * 0.02).astype(np.float32)
        w.add_tensor(name, v)
        out[name] = v

    add("token_embd.weight", ty["embd"], n_vocab, n_embd, 0.5)
    for il in range(n_layer):
        p = f"blk.{il}."
        add_vec(p + "attn_norm.weight", n_embd, 1.0)
        add(p + "attn_q.weight", ty["attn"], n_embd, n_embd)
        add(p + "attn_k.weight", ty["attn"], n_head_kv * head_dim, n_embd)
        add(p + "attn_v.weight", ty["attn"], n_head_kv * head_dim, n_embd)
        if arch == "qwen2":
            add_vec(p + "attn_q.bias", n_embd)
            add_vec(p + "attn_k.bias", n_head_kv * head_dim)
            add_vec(p + "attn_v.bias", n_head_kv * head_dim)
        add(p + "attn_output.weight", ty["attn"], n_embd, n_embd)
        add_vec(p + "ffn_norm.weight", n_embd, 1.0)
        if moe_experts:
            add(p + "ffn_gate_inp.weight", "F32", moe_experts, n_embd)
            for role, rows, cols in (("gate", n_ff, n_embd), ("up", n_ff, n_embd), ("down", n_embd, n_ff)):
                e = (rng.standard_normal((moe_experts, rows, cols)) * 0.05).astype(np.float16)
                w.add_tensor(p + f"ffn_{role}_exps.weight", e)
                out[p + f"ffn_{role}_exps.weight"] = e.astype(np.float32)
            continue
        if gated:
            add(p + "ffn_gate.weight", ffn_type("gate", il), n_ff, n_embd)
        add(p + "ffn_up.weight", ffn_type("up", il), n_ff, n_embd)
        add(p + "ffn_down.weight", ffn_type("down", il), n_embd, n_ff)
    add_vec("output_norm.weight", n_embd, 1.0)
    add("output.weight", ty["output"], n_vocab, n_embd)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
