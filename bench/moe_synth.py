"""A Qwen3-30B-A3B-shaped mixture-of-experts GGUF for the MoE benchmarks, written one tensor at a time.

    python bench/moe_synth.py /data/qwen3moe-16l.gguf --layers 16     # ~6.6 GB
    python bench/moe_synth.py /data/qwen3moe-48l.gguf --layers 48     # the whole model's depth, ~19.4 GB
    python bench/moe_synth.py /tmp/qwen3moe-2l.gguf --layers 2 --decode   # a smoke run, decoded by stock llama.cpp
    python bench/moe_synth.py /data/qwen3moe-16l-cal.gguf --routing calibrated   # routes like Qwen3-30B-A3B
    python bench/moe_synth.py /data/gpt-oss-24l-cal.gguf --arch gpt-oss --routing calibrated   # gpt-oss-20b, ~12.0 GB

Qwen3-30B-A3B's shape ("qwen3moe": n_embd 2048; 32 query heads and 4 key/value heads of 128 with
per-head q/k norms; 128 experts of 768 neurons, 8 routed per token, softmax-normalized; RMS eps
1e-6, rope base 1e6) in its Q4_K_M layout: the experts' gate and up Q4_K and down Q6_K, attention
q/k/output Q4_K and v Q6_K, token_embd Q4_K (Q8_0 in --routing calibrated/flat), output Q6_K, the norms and the router (ffn_gate_inp)
F32; the tokenizer and chat template of SmolLM2-135M-Instruct (49152 tokens, from
leanstream_ggml.model.registry.fetch) instead of Qwen's 151k, so the output matrix is smaller than the
real model's. The weights are random: quantized blocks of random bytes whose f16 scales give
values of standard deviation ~0.02, and router rows spread so that some experts are routed to
more often than others. Deterministic per --seed.

--routing (the experts' tensors are the same bytes in every mode; bench/routing_probe.py's figures
over the first 128 tokens of heldout-technical.txt, per layer mean (min..max over the layers)):

    mode         layers  distinct       lag-1 reuse          top-8 share          next-layer recall
    narrow       2       38.5 (31..46)  0.75 (0.71..0.80)    0.70 (0.67..0.74)    0.07
    narrow       16      48.2 (31..54)  0.73 (0.66..0.82)    0.69 (0.60..0.80)    0.91 (0.07..0.99)
    calibrated   2       69.0 (68..70)  0.35 (0.34..0.35)    0.50 (0.49..0.51)    0.76
    calibrated   16      68.8 (61..77)  0.33 (0.28..0.39)    0.48 (0.41..0.55)    0.80 (0.76..0.82)
    calibrated   48 (a)  68.6 (60..79)  0.34 (0.28..0.40)    0.48 (0.41..0.56)    0.80 (0.76..0.83)
    flat         2       94.5 (94..95)  0.20 (0.17..0.23)    0.31 (0.28..0.34)    0.69
    flat         16      93.4 (86..101) 0.22 (0.17..0.29)    0.34 (0.28..0.41)    0.78 (0.69..0.81)
    Qwen3-30B-A3B        ~64            ~0.38                ~0.445               0.66-0.88
    (a) routing_probe.py --no-repack (19.5 GB, mmapped); without norm_gain (0) calibrated's
        recall was 0.96 (0.83..0.98) on 16 layers, flat's 0.96 (0.77..0.98)

narrow (the default; every result before --routing was measured on it): random Q4_K blocks have a
positive mean (about their std), a rank-one all-ones part in every matrix, which swamps the
residual stream (layer 0's MoE output RMS ~330): few experts, hot and sticky. calibrated and flat
(ROUTING's knobs): token_embd Q8_0, each row emb_scale * (shared * u + (1 - shared^2)^0.5 * r_t)
with u one direction common to every token; attn_output zero-mean Q4_K (Writer.quant_rows
symmetric) of std STD * attn_out * attn_decay^layer (layer 0's attention mixes the context in,
the later ones add little, so the mix holds with depth); each layer's router row e has, along the
unit direction the tokens share (u and layer 0's attention of it: popular_direction), a weight
from a fixed normal-quantile profile times ``popularity`` in a random order per layer (so every
layer has the same popularity spread, not a chance one), and row spreads evenly spaced in
router_spread; each layer's ffn_norm weight per channel exp(norm_gain N(0, 1)) scaled to RMS 1, a
fresh draw per layer as real models' differ by layer and channel, and its router divided by it
(the layer routes as without it: (router / g) (g x) = router x), so only the read-ahead guess, layer
n+1's router on layer n's normed input, sees the ratio of two layers' gains (next-layer recall
0.96 -> 0.80 on 16 layers at 0.2; the other figures unchanged). calibrated: emb_scale 4, shared
0.45, attn_out 4.5, attn_decay 0.3, popularity 1.3, norm_gain 0.2; flat: shared 0.2, attn_out 8,
popularity 1.2, norm_gain 0.2. Lag-1 reuse stays a little under the real model's
for its top-8 share: the random attention averages the whole context, not the last few tokens.

--arch gpt-oss: gpt-oss-20b's shape ("gpt-oss", llama.cpp's LLM_ARCH_OPENAI_MOE; --layers 24 by
default, ~12.0 GB, like the real MXFP4 GGUF's ~12-13 GB): n_embd 2880; 64 query heads and 8
key/value heads of 64 with q/k/v/output biases and per-head attention sinks (attn_sinks), no q/k
norms; a sliding window of 128 on the even layers (0, 2, ...; llama.cpp's default pattern for the
architecture, from attention.sliding_window); the FFN's norm is post_attention_norm; 32 experts of
2880 neurons, 4 routed per token (softmax over the 4 chosen logits; SwiGLU-OAI), with per-expert
gate/up/down biases (ffn_*_exps.bias [n_ff or n_embd, n_expert], F32) and a router bias
(ffn_gate_inp.bias); RMS eps 1e-5, rope base 150000 with YaRN x32 from 4096. Layout: the experts
MXFP4 (blocks of 32 values: an E8M0 exponent byte e and 16 bytes of e2m1 codes, value = doubled
e2m1 * 2^(e - 128)), random codes (zero mean, unlike Q4_K's) under exponents 119/120 mixed so the
values' RMS is 0.02; attention BF16 (N(0, 0.02^2)), token_embd and output F16, the rest F32; the
same 49152-token tokenizer. Biases are N(0, 0.02^2), the router's N(0, 0.1^2), the sinks N(0, 0.5^2).
--routing builds the router as for qwen3moe, with 32 experts (the profile is 32 normal quantiles),
the same knobs, the popular direction including layer 0's v and output biases, and the norm
gains on post_attention_norm (figures over 2 layers, 32 experts top-4, as above; next-layer
recall from attn_post_norm-0, which routing_probe.py does not capture yet; uniform routing would
give lag-1 0.125 and top-8 share 0.25):

    mode         layers  distinct       lag-1 reuse          top-8 share          next-layer recall
    narrow       2       31.5 (31..32)  0.21 (0.20..0.23)    0.53 (0.52..0.55)    0.37
    calibrated   2       25.5 (25..26)  0.34 (0.29..0.38)    0.73 (0.70..0.76)    0.73
    flat         2       29.5 (29..30)  0.25 (0.22..0.28)    0.58 (0.54..0.62)    0.71

The knobs were fitted to Qwen3-30B-A3B, not to gpt-oss-20b's own routing (no figures for it here).

Memory: one matrix at a time (an expert's, or up to 4096 rows of the others'): the header is
written first, then each tensor's bytes are appended in order (gguf-py's GGUFWriter lays out the
tensor infos; the data is aligned as it expects). The file is written under a temporary name and
renamed. After writing, gguf-py's reader checks the layout (every tensor where its info says);
--decode also loads the file in stock llama-cpp-python and decodes a few tokens (finite logits).
Prints one JSON object: path, bytes, seconds, the shape and types.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

import benchkit

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM = 2048, 32, 4, 128
N_EXPERT, N_EXPERT_USED, N_FF_EXP, N_FF_DENSE = 128, 8, 768, 6144
STD = 0.02                   # the weights' standard deviation
CHUNK_ROWS = 4096            # rows generated and written at a time (the non-expert matrices)
# the Q4_K_M layout of Qwen3-30B-A3B's GGUFs, by tensor
TYPES = {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K", "attn_q": "Q4_K",
         "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "token_embd": "Q4_K", "output": "Q6_K"}
# --routing: knobs of the generator's non-expert tensors (None: as it always was)
ROUTING = {
    "narrow": None,
    "calibrated": {"emb_scale": 4.0, "shared": 0.45, "attn_out": 4.5, "attn_decay": 0.3, "qk_symmetric": False,
                   "router_std": 2.0, "router_spread": (0.5, 1.5), "popularity": 1.3, "norm_gain": 0.2},
    "flat": {"emb_scale": 4.0, "shared": 0.2, "attn_out": 8.0, "attn_decay": 0.3, "qk_symmetric": False,
             "router_std": 2.0, "router_spread": (0.5, 1.5), "popularity": 1.2, "norm_gain": 0.2},
}
# byte offsets of the f16 scale fields in one K-quant block (ggml-common.h block_q4_K / block_q6_K)
F16_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,)}
SYM_Q4K_STD = 15 * (255 / 12) ** 0.5   # std of 15 (q - 7.5), q uniform in 0..15 (quant_rows symmetric, d = 1)

# --arch gpt-oss: gpt-oss-20b's shape and the layout of its MXFP4 GGUF, by tensor
GPT_OSS = {"n_embd": 2880, "n_head": 64, "n_head_kv": 8, "head_dim": 64, "n_expert": 32, "n_expert_used": 4,
           "n_ff_exp": 2880, "n_layer": 24, "sliding_window": 128}
GPT_OSS_TYPES = {"ffn_gate_exps": "MXFP4", "ffn_up_exps": "MXFP4", "ffn_down_exps": "MXFP4", "attn_q": "BF16",
                 "attn_k": "BF16", "attn_v": "BF16", "attn_output": "BF16", "token_embd": "F16", "output": "F16"}
GPT_OSS_BIAS_STD = {"attn": STD, "experts": STD, "router": 0.1, "sinks": 0.5}   # the F32 biases' and sinks' std
# MXFP4 (ggml-common.h block_mxfp4): 32 values a block, 1 byte E8M0 exponent e then 16 bytes of
# 4-bit e2m1 codes (value j in byte j's low nibble, value j + 16 in its high one); a value is
# E2M1_X2[code] * 2^(e - 128) (ggml's kvalues_mxfp4, the e2m1 values doubled, times half the scale)
E2M1_X2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float64)
MXFP4_UNIT = float(np.sqrt((E2M1_X2 ** 2).mean()))     # std of a random block's values at e = 128


def mxfp4_exponents(std: float) -> tuple[int, float]:
    """(e, p): random MXFP4 blocks whose exponent byte is e + 1 with probability p, else e, have
    values of RMS ``std`` (a power-of-two scale only: a mix of the two bracketing ones)."""
    e = 128 + int(np.floor(np.log2(std / MXFP4_UNIT)))
    lo, hi = (MXFP4_UNIT * 2.0 ** (e - 128)) ** 2, (MXFP4_UNIT * 2.0 ** (e - 127)) ** 2
    return e, (std * std - lo) / (hi - lo)


def _unit_scale(gguf, qtype) -> float:
    """Standard deviation of a random block's values when its f16 scales are 1 (to scale them to STD)."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, size=(256, ts), dtype=np.uint8)
    one = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    for off in F16_FIELDS[qtype.name]:
        raw[:, off:off + 2] = one
    return float(gguf.quants.dequantize(raw.reshape(-1), qtype).std())


class Writer:
    """The tensors' infos first (shape, type, bytes), then their data in the same order, one chunk
    at a time."""

    def __init__(self, path: Path, arch: str):
        import gguf

        self.gguf = gguf
        self.w = gguf.GGUFWriter(os.fspath(path), arch)
        self.plan: list[tuple[str, str, int, object]] = []    # (name, type, bytes, its chunks in order)
        self.unit = {t: _unit_scale(gguf, gguf.GGMLQuantizationType[t]) for t in F16_FIELDS}

    def tensor(self, name: str, type_name: str, shape: tuple[int, ...], chunks) -> None:
        """shape: numpy order ([experts,] rows, row length); chunks: a callable giving the bytes in order."""
        gguf = self.gguf
        qt = gguf.GGMLQuantizationType[type_name]
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        n = int(np.prod(shape))
        nbytes = n // bs * ts
        if type_name == "F32":
            self.w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:   # gguf-py takes a quantized tensor's shape in bytes: [..., row bytes]
            self.w.add_tensor_info(name, (*shape[:-1], shape[-1] // bs * ts), np.dtype(np.uint8), nbytes, raw_dtype=qt)
        self.plan.append((name, type_name, nbytes, chunks))

    def quant_rows(self, rng, type_name: str, rows: int, cols: int, scale: float = 1.0,
                   symmetric: bool = False) -> np.ndarray:
        """uint8 [rows, row bytes]: random K-quant blocks, scales drawn so the values have std
        ~STD * scale. Random Q4_K blocks have a positive mean (d sc q - dmin m, 6-bit sc and m
        alike): a rank-one all-ones component in every matrix. ``symmetric`` (Q4_K only): every
        sub-block scale and min 15 and dmin = 7.5 d, values 15 d (q - 7.5), mean zero."""
        if type_name == "MXFP4":
            return self.mxfp4_rows(rng, rows, cols, scale)
        if type_name in ("F32", "F16", "BF16"):
            return self.float_rows(rng, type_name, rows, cols, scale)
        gguf = self.gguf
        qt = gguf.GGMLQuantizationType[type_name]
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        nb = rows * cols // bs
        raw = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)
        if symmetric:
            assert type_name == "Q4_K"
            d = rng.uniform(0.5, 1.5, size=nb) * STD * scale / SYM_Q4K_STD
            raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
            raw[:, 2:4] = (7.5 * d).astype(np.float16).view(np.uint8).reshape(nb, 2)
            raw[:, 4:16] = [15] * 8 + [15 | 15 << 4] * 4          # scales[12]: sc = m = 15, high bits 0
            return raw.reshape(rows, -1)
        d = (rng.uniform(0.5, 1.5, size=nb) * STD * scale / self.unit[type_name]).astype(np.float16).view(np.uint8)
        for off in F16_FIELDS[type_name]:
            raw[:, off:off + 2] = d.reshape(nb, 2)
        return raw.reshape(rows, -1)

    def mxfp4_rows(self, rng, rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        """uint8 [rows, row bytes]: random MXFP4 blocks (random e2m1 codes: zero mean), each
        block's exponent one of the two powers of two bracketing STD * scale, mixed so the values'
        RMS is STD * scale (mxfp4_exponents)."""
        nb = rows * cols // 32
        raw = rng.integers(0, 256, size=(nb, 17), dtype=np.uint8)
        e, p = mxfp4_exponents(STD * scale)
        raw[:, 0] = e + (rng.random(nb) < p)
        return raw.reshape(rows, -1)

    def float_rows(self, rng, type_name: str, rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        """uint8 [rows, row bytes]: N(0, (STD * scale)^2) values as F32, F16 or BF16."""
        x = (rng.standard_normal((rows, cols)) * (STD * scale)).astype(np.float32)
        q = self.gguf.quants.quantize(x, self.gguf.GGMLQuantizationType[type_name])
        return np.ascontiguousarray(q).view(np.uint8).reshape(rows, -1)

    def write(self) -> None:
        w = self.w
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        f = w.fout[0]
        align = w.data_alignment
        f.write(bytes(-f.tell() % align))                         # the data section starts aligned
        for name, _, nbytes, chunks in self.plan:
            done = 0
            for c in chunks():
                b = memoryview(np.ascontiguousarray(c)).cast("B")
                f.write(b)
                done += len(b)
            if done != nbytes:
                raise RuntimeError(f"{name}: wrote {done} bytes, its info says {nbytes}")
            f.write(bytes(-done % align))                         # each tensor padded to the alignment
        w.close()


def matrix_chunks(W: Writer, seed: int, sub: int, type_name: str, rows: int, cols: int, **kw):
    """A matrix's bytes in chunks of CHUNK_ROWS rows, from its own random stream ([seed, sub]);
    ``kw``: Writer.quant_rows's scale and symmetric."""
    def chunks():
        r = np.random.default_rng([seed, sub])
        for first in range(0, rows, CHUNK_ROWS):
            yield W.quant_rows(r, type_name, min(CHUNK_ROWS, rows - first), cols, **kw)
    return chunks


def const_chunks(values: np.ndarray):
    return lambda: iter([values])


def copy_tokenizer(w, src: Path) -> int:
    """Every tokenizer.* key of ``src`` into the writer, byte for byte; returns the vocabulary size."""
    import gguf

    V = gguf.GGUFValueType
    r = gguf.GGUFReader(src)
    n_vocab = 0
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == V.STRING:
            w.add_key_value(key, bytes(field.parts[-1]), vtype)
        elif vtype == V.ARRAY:
            sub = field.types[1]
            if sub == V.STRING:
                val = [bytes(field.parts[i]) for i in field.data]
            else:
                val = np.concatenate([field.parts[i] for i in field.data]).tolist()
            w.add_key_value(key, val, vtype, sub)
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(val)
        else:
            w.add_key_value(key, field.parts[-1][0].item(), vtype)
    del r
    return n_vocab


def embedding_chunks(W: Writer, seed: int, sub: int, rows: int, knobs: dict, n_embd: int = N_EMBD,
                     type_name: str = "Q8_0"):
    """token_embd of the calibrated/flat modes, Q8_0 (gguf-py quantizes; F16 for gpt-oss): each row
    emb_scale * (shared * u + (1 - shared^2)^0.5 * r), u one unit-RMS zero-sum direction common to
    every token (a popularity bias in every layer's router logits), r the token's own N(0, 1) row."""
    gguf = W.gguf
    u = shared_direction(seed, sub, n_embd)

    def chunks():
        r = np.random.default_rng([seed, sub])
        a = knobs["shared"]
        for first in range(0, rows, CHUNK_ROWS):
            x = r.standard_normal((min(CHUNK_ROWS, rows - first), n_embd)) * (1 - a * a) ** 0.5 + a * u
            yield gguf.quants.quantize((x * knobs["emb_scale"]).astype(np.float32), gguf.GGMLQuantizationType[type_name])
    return chunks


def shared_direction(seed: int, sub: int, n_embd: int = N_EMBD) -> np.ndarray:
    """u of embedding_chunks: unit RMS, zero sum."""
    u = np.random.default_rng([seed, sub, 0]).standard_normal(n_embd)
    u -= u.mean()
    return u / np.sqrt((u ** 2).mean())


def popular_direction(W: Writer, knobs: dict, u: np.ndarray, v_chunks, o_chunks, heads_shape=None,
                      types: dict = TYPES, v_bias=None, o_bias=None) -> np.ndarray:
    """The unit direction every token's FFN input shares (calibrated/flat): the embeddings'
    emb_scale * shared * u plus what layer 0's attention makes of it, W_o (W_v shared * u) (the
    attention weights sum to 1; each query head reads key/value head h // (n_head / n_head_kv)).
    ``heads_shape``: (n_embd, n_head, n_head_kv, head_dim), default qwen3moe's; ``v_bias``/``o_bias``
    (gpt-oss): W_o (W_v shared * u + b_v) + b_o."""
    n_embd, n_head, n_head_kv, head_dim = heads_shape or (N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM)
    gguf = W.gguf
    deq = lambda chunks, t, cols: np.concatenate([gguf.quants.dequantize(c, gguf.GGMLQuantizationType[t]) for c in chunks()]).reshape(-1, cols)
    vu = deq(v_chunks, types["attn_v"], n_embd) @ (knobs["shared"] * u)                     # [n_head_kv * head_dim]
    if v_bias is not None:
        vu = vu + v_bias
    heads = vu.reshape(n_head_kv, head_dim)[np.arange(n_head) // (n_head // n_head_kv)].reshape(-1)
    c = knobs["emb_scale"] * knobs["shared"] * u + deq(o_chunks, types["attn_output"], n_head * head_dim) @ heads
    if o_bias is not None:
        c = c + o_bias
    return c / np.linalg.norm(c)


def norm_gains(seed: int, il: int, sigma: float, n_embd: int = N_EMBD) -> np.ndarray | None:
    """Layer il's ffn_norm weight (calibrated/flat): per channel exp(sigma N(0, 1)), a fresh draw
    per layer (its own stream, [seed, 0, il]), scaled to RMS 1; None when sigma is 0 (all ones)."""
    if not sigma:
        return None
    g = np.exp(sigma * np.random.default_rng([seed, 0, il]).standard_normal(n_embd))
    return (g / np.sqrt((g ** 2).mean())).astype(np.float32)


def write_model(path: Path, n_layer: int, tokenizer: Path, seed: int = 0, routing: str | dict = "narrow",
                arch: str = "qwen3moe") -> dict:
    """The GGUF at ``path`` (written as path + ".partial", then renamed); its shape as a dict.
    ``routing``: a ROUTING mode's name, or its knobs as a dict; ``arch``: qwen3moe or gpt-oss
    (write_gpt_oss)."""
    if arch == "gpt-oss":
        return write_gpt_oss(path, n_layer, tokenizer, seed, routing)
    if arch != "qwen3moe":
        raise ValueError(f"arch: qwen3moe or gpt-oss, not {arch!r}")
    knobs = ROUTING[routing] if isinstance(routing, str) else routing
    types = dict(TYPES, token_embd="Q8_0") if knobs else TYPES
    tmp = path.with_name(path.name + ".partial")
    rng = np.random.default_rng(seed)
    W = Writer(tmp, "qwen3moe")
    w = W.w
    w.add_type("model")
    w.add_name(f"qwen3moe-30b-a3b-shaped-{n_layer}l-synthetic")
    w.add_file_type(15)                                   # LLAMA_FTYPE_MOSTLY_Q4_K_M
    w.add_context_length(32768)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(N_FF_DENSE)
    w.add_expert_feed_forward_length(N_FF_EXP)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(N_EXPERT)
    w.add_expert_used_count(N_EXPERT_USED)
    n_vocab = copy_tokenizer(w, tokenizer)

    def quant(type_name, rows, cols, sub, **kw):     # a matrix in chunks of CHUNK_ROWS rows, from its own stream
        return matrix_chunks(W, seed, sub, type_name, rows, cols, **kw)

    def experts(type_name, rows, cols, sub):   # one expert's matrix at a time
        def chunks():
            r = np.random.default_rng([seed, sub])
            for _ in range(N_EXPERT):
                yield W.quant_rows(r, type_name, rows, cols)
        return chunks

    const = const_chunks

    sub = iter(range(1, 1 << 30))
    if knobs:
        emb_sub = next(sub)
        W.tensor("token_embd.weight", "Q8_0", (n_vocab, N_EMBD), embedding_chunks(W, seed, emb_sub, n_vocab, knobs))
        # the popularity profile: normal quantiles, in a random order per layer
        from statistics import NormalDist
        profile = np.array([NormalDist().inv_cdf((i + 0.5) / N_EXPERT) for i in range(N_EXPERT)])
    else:
        W.tensor("token_embd.weight", TYPES["token_embd"], (n_vocab, N_EMBD),
                 quant(TYPES["token_embd"], n_vocab, N_EMBD, next(sub)))
    q, kv = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    planned = {}
    for il in range(n_layer):
        p = f"blk.{il}."
        ones = np.ones(N_EMBD, np.float32)
        W.tensor(p + "attn_norm.weight", "F32", (N_EMBD,), const(ones))
        for name, rows, cols in (("attn_q", q, N_EMBD), ("attn_k", kv, N_EMBD), ("attn_v", kv, N_EMBD),
                                 ("attn_output", N_EMBD, q)):
            kw = {}
            if knobs and name == "attn_output":    # zero mean; the context's share of the residual
                kw = {"scale": knobs["attn_out"] * knobs["attn_decay"] ** il, "symmetric": True}
            elif knobs and name in ("attn_q", "attn_k") and knobs["qk_symmetric"]:
                kw = {"symmetric": True}
            planned[name] = quant(TYPES[name], rows, cols, next(sub), **kw)
            W.tensor(p + name + ".weight", TYPES[name], (rows, cols), planned[name])
        if knobs and il == 0:
            c_hat = popular_direction(W, knobs, shared_direction(seed, emb_sub), planned["attn_v"], planned["attn_output"])
        W.tensor(p + "attn_q_norm.weight", "F32", (HEAD_DIM,), const(np.ones(HEAD_DIM, np.float32)))
        W.tensor(p + "attn_k_norm.weight", "F32", (HEAD_DIM,), const(np.ones(HEAD_DIM, np.float32)))
        gain = norm_gains(seed, il, knobs.get("norm_gain", 0.0)) if knobs else None
        W.tensor(p + "ffn_norm.weight", "F32", (N_EMBD,), const(ones if gain is None else gain))
        # router logits of spread ~2 on the normed input, some experts' rows larger than others'
        lo, hi = knobs["router_spread"] if knobs else (0.5, 1.5)
        std = knobs["router_std"] if knobs else 2.0
        if knobs:   # evenly spaced, in a random order (fewer chance extremes than random draws)
            spread = (lo + (hi - lo) * (rng.permutation(N_EXPERT) + 0.5) / N_EXPERT).astype(np.float32)
        else:
            spread = rng.uniform(lo, hi, N_EXPERT).astype(np.float32)
        router = (rng.standard_normal((N_EXPERT, N_EMBD)) * std / N_EMBD ** 0.5).astype(np.float32) * spread[:, None]
        if knobs:   # each expert's weight on the shared direction: the profile's, not a random draw's
            pop = knobs["popularity"] * std / N_EMBD ** 0.5 * spread * rng.permutation(profile)
            router = (router - np.outer(router @ c_hat, c_hat) + np.outer(pop, c_hat)).astype(np.float32)
            if gain is not None:    # router (gain * x) = the designed router's x: the layer routes as without
                router = (router / gain).astype(np.float32)
        W.tensor(p + "ffn_gate_inp.weight", "F32", (N_EXPERT, N_EMBD), const(router))
        for name, rows, cols in (("ffn_gate_exps", N_FF_EXP, N_EMBD), ("ffn_up_exps", N_FF_EXP, N_EMBD),
                                 ("ffn_down_exps", N_EMBD, N_FF_EXP)):
            W.tensor(p + name + ".weight", TYPES[name], (N_EXPERT, rows, cols),
                     experts(TYPES[name], rows, cols, next(sub)))
    W.tensor("output_norm.weight", "F32", (N_EMBD,), const(np.ones(N_EMBD, np.float32)))
    W.tensor("output.weight", TYPES["output"], (n_vocab, N_EMBD), quant(TYPES["output"], n_vocab, N_EMBD, next(sub)))
    W.write()
    os.replace(tmp, path)
    return {"arch": "qwen3moe", "n_layer": n_layer, "n_embd": N_EMBD, "n_head": N_HEAD, "n_head_kv": N_HEAD_KV,
            "head_dim": HEAD_DIM,
            "n_expert": N_EXPERT, "n_expert_used": N_EXPERT_USED, "n_ff_exp": N_FF_EXP, "n_vocab": n_vocab,
            "types": types, "routing": routing if isinstance(routing, str) else knobs, "tensors": len(W.plan)}


def write_gpt_oss(path: Path, n_layer: int, tokenizer: Path, seed: int = 0, routing: str | dict = "narrow") -> dict:
    """write_model's gpt-oss: gpt-oss-20b's shape (GPT_OSS) in the layout of its MXFP4 GGUF
    (GPT_OSS_TYPES), the routing modes' knobs as for qwen3moe; its shape as a dict."""
    import gguf

    S, T = GPT_OSS, GPT_OSS_TYPES
    knobs = ROUTING[routing] if isinstance(routing, str) else routing
    n_embd, n_head, n_head_kv, hd = S["n_embd"], S["n_head"], S["n_head_kv"], S["head_dim"]
    n_expert, n_ff = S["n_expert"], S["n_ff_exp"]
    tmp = path.with_name(path.name + ".partial")
    rng = np.random.default_rng(seed)
    W = Writer(tmp, "gpt-oss")
    w = W.w
    w.add_type("model")
    w.add_name(f"gpt-oss-20b-shaped-{n_layer}l-synthetic")
    w.add_file_type(38)                                   # LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    w.add_context_length(131072)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_expert_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_sliding_window(S["sliding_window"])            # llama.cpp: every even layer (0, 2, ...) sliding
    w.add_expert_count(n_expert)
    w.add_expert_used_count(S["n_expert_used"])
    n_vocab = copy_tokenizer(w, tokenizer)

    def quant(type_name, rows, cols, sub, **kw):
        return matrix_chunks(W, seed, sub, type_name, rows, cols, **kw)

    def experts(type_name, rows, cols, sub):   # one expert's matrix at a time
        def chunks():
            r = np.random.default_rng([seed, sub])
            for _ in range(n_expert):
                yield W.quant_rows(r, type_name, rows, cols)
        return chunks

    def normal(shape, std, sub):                # small F32 vectors (biases, sinks), each from its own stream
        return (np.random.default_rng([seed, sub]).standard_normal(shape) * std).astype(np.float32)

    const = const_chunks
    sub = iter(range(1, 1 << 30))
    emb_sub = next(sub)
    if knobs:
        W.tensor("token_embd.weight", T["token_embd"], (n_vocab, n_embd),
                 embedding_chunks(W, seed, emb_sub, n_vocab, knobs, n_embd, T["token_embd"]))
        from statistics import NormalDist
        profile = np.array([NormalDist().inv_cdf((i + 0.5) / n_expert) for i in range(n_expert)])
    else:
        W.tensor("token_embd.weight", T["token_embd"], (n_vocab, n_embd), quant(T["token_embd"], n_vocab, n_embd, emb_sub))
    q, kv = n_head * hd, n_head_kv * hd
    ones = np.ones(n_embd, np.float32)
    for il in range(n_layer):
        p = f"blk.{il}."
        W.tensor(p + "attn_norm.weight", "F32", (n_embd,), const(ones))
        planned, bias = {}, {}
        for name, rows, cols in (("attn_q", q, n_embd), ("attn_k", kv, n_embd), ("attn_v", kv, n_embd),
                                 ("attn_output", n_embd, q)):
            kw = {"scale": knobs["attn_out"] * knobs["attn_decay"] ** il} if knobs and name == "attn_output" else {}
            planned[name] = quant(T[name], rows, cols, next(sub), **kw)
            W.tensor(p + name + ".weight", T[name], (rows, cols), planned[name])
            bias[name] = normal(rows, GPT_OSS_BIAS_STD["attn"], next(sub))
            W.tensor(p + name + ".bias", "F32", (rows,), const(bias[name]))
        if knobs and il == 0:
            c_hat = popular_direction(W, knobs, shared_direction(seed, emb_sub, n_embd), planned["attn_v"],
                                      planned["attn_output"], (n_embd, n_head, n_head_kv, hd), T,
                                      bias["attn_v"], bias["attn_output"])
        W.tensor(p + "attn_sinks.weight", "F32", (n_head,), const(normal(n_head, GPT_OSS_BIAS_STD["sinks"], next(sub))))
        gain = norm_gains(seed, il, knobs.get("norm_gain", 0.0), n_embd) if knobs else None
        W.tensor(p + "post_attention_norm.weight", "F32", (n_embd,), const(ones if gain is None else gain))
        # the router as qwen3moe's (write_model), for 32 experts
        lo, hi = knobs["router_spread"] if knobs else (0.5, 1.5)
        std = knobs["router_std"] if knobs else 2.0
        if knobs:
            spread = (lo + (hi - lo) * (rng.permutation(n_expert) + 0.5) / n_expert).astype(np.float32)
        else:
            spread = rng.uniform(lo, hi, n_expert).astype(np.float32)
        router = (rng.standard_normal((n_expert, n_embd)) * std / n_embd ** 0.5).astype(np.float32) * spread[:, None]
        if knobs:
            pop = knobs["popularity"] * std / n_embd ** 0.5 * spread * rng.permutation(profile)
            router = (router - np.outer(router @ c_hat, c_hat) + np.outer(pop, c_hat)).astype(np.float32)
            if gain is not None:
                router = (router / gain).astype(np.float32)
        W.tensor(p + "ffn_gate_inp.weight", "F32", (n_expert, n_embd), const(router))
        W.tensor(p + "ffn_gate_inp.bias", "F32", (n_expert,), const(normal(n_expert, GPT_OSS_BIAS_STD["router"], next(sub))))
        for name, rows, cols in (("ffn_gate_exps", n_ff, n_embd), ("ffn_up_exps", n_ff, n_embd),
                                 ("ffn_down_exps", n_embd, n_ff)):
            W.tensor(p + name + ".weight", T[name], (n_expert, rows, cols), experts(T[name], rows, cols, next(sub)))
            W.tensor(p + name + ".bias", "F32", (n_expert, rows),
                     const(normal((n_expert, rows), GPT_OSS_BIAS_STD["experts"], next(sub))))
    W.tensor("output_norm.weight", "F32", (n_embd,), const(ones))
    W.tensor("output.weight", T["output"], (n_vocab, n_embd), quant(T["output"], n_vocab, n_embd, next(sub)))
    W.write()
    os.replace(tmp, path)
    return {"arch": "gpt-oss", "n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "n_head_kv": n_head_kv,
            "head_dim": hd, "n_expert": n_expert, "n_expert_used": S["n_expert_used"], "n_ff_exp": n_ff,
            "sliding_window": S["sliding_window"], "n_vocab": n_vocab, "types": T,
            "routing": routing if isinstance(routing, str) else knobs, "tensors": len(W.plan)}


def expected_bytes(n_layer: int, n_vocab: int = 49152, arch: str = "qwen3moe") -> int:
    """About what the file takes (the tensor data; the header is a few MB)."""
    if arch == "gpt-oss":
        S, size = GPT_OSS, {"MXFP4": 17 / 32, "BF16": 2, "F16": 2, "Q8_0": 34 / 32}
        E, F, D = S["n_expert"], S["n_ff_exp"], S["n_embd"]
        q, kv = S["n_head"] * S["head_dim"], S["n_head_kv"] * S["head_dim"]
        layer = (3 * E * F * D * size[GPT_OSS_TYPES["ffn_gate_exps"]] + 2 * D * (q + kv) * size[GPT_OSS_TYPES["attn_q"]]
                 + 4 * (E * D + E * (2 * F + D) + E + q + 2 * kv + D + S["n_head"] + 2 * D))
        return int(n_layer * layer + n_vocab * D * (size[GPT_OSS_TYPES["token_embd"]] + size[GPT_OSS_TYPES["output"]]))
    q4k, q6k = 144 / 256, 210 / 256
    layer = (N_EXPERT * N_FF_EXP * N_EMBD * (2 * q4k + q6k) + N_EMBD * N_HEAD * HEAD_DIM * 2 * q4k
             + N_EMBD * N_HEAD_KV * HEAD_DIM * (q4k + q6k) + 4 * N_EXPERT * N_EMBD)
    return int(n_layer * layer + n_vocab * N_EMBD * (q4k + q6k))


def read_layout(path: Path, n_tensors: int):
    """gguf-py reads it back: ``n_tensors`` tensors, each after the previous one's bytes, the last
    inside the file. (the reader, {name: its tensor})"""
    import gguf

    r = gguf.GGUFReader(path)
    assert len(r.tensors) == n_tensors, (len(r.tensors), n_tensors)
    for prev, x in zip(r.tensors, r.tensors[1:]):
        assert x.data_offset >= prev.data_offset + prev.n_bytes, (prev.name, x.name)
    last = r.tensors[-1]
    assert last.data_offset + last.n_bytes <= path.stat().st_size
    return r, {x.name: x for x in r.tensors}


def check_layout(path: Path, shape: dict) -> None:
    """gguf-py reads it back: every tensor where its info says, the expert count and types as
    written; gpt-oss: also the biases' and sinks' shapes, the sliding window, and the experts'
    MXFP4 values (one expert's gate) of std ~STD."""
    import gguf

    arch = shape.get("arch", "qwen3moe")
    D, F, E, types = shape["n_embd"], shape["n_ff_exp"], shape["n_expert"], shape["types"]
    r, t = read_layout(path, shape["tensors"])
    dims = lambda name: [int(x) for x in t[name].shape]
    g = t["blk.0.ffn_gate_exps.weight"]
    assert dims(g.name) == [D, F, E] and g.tensor_type.name == types["ffn_gate_exps"]
    assert t["blk.0.ffn_down_exps.weight"].tensor_type.name == types["ffn_down_exps"]
    assert r.get_field(f"{arch}.expert_count").contents() == E
    if arch != "gpt-oss":
        return
    assert dims("blk.0.ffn_gate_exps.bias") == dims("blk.0.ffn_up_exps.bias") == [F, E]
    assert dims("blk.0.ffn_down_exps.bias") == [D, E] and dims("blk.0.ffn_gate_inp.bias") == [E]
    assert dims("blk.0.ffn_gate_inp.weight") == [D, E]
    assert dims("blk.0.attn_sinks.weight") == [shape["n_head"]]
    assert dims("blk.0.attn_q.bias") == [shape["n_head"] * shape["head_dim"]]
    assert r.get_field("gpt-oss.attention.sliding_window").contents() == shape["sliding_window"]
    one = np.asarray(g.data).reshape(-1)[: F * D // 32 * 17]          # expert 0's gate
    std = float(gguf.quants.dequantize(one, gguf.GGMLQuantizationType.MXFP4).std())
    assert abs(std / STD - 1) < 0.05, std


def decode(path: Path, n_tokens: int = 4) -> dict:
    """Stock llama-cpp-python loads the file and decodes a few tokens."""
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(os.fspath(path), n_ctx=64, n_threads=2, verbose=False, logits_all=True)
    try:
        toks = llm.tokenize(b"The capital of France is", add_bos=False)
        load = time.perf_counter() - t0
        llm.eval(toks)
        out = []
        for _ in range(n_tokens):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            if not np.isfinite(llm.scores[llm.n_tokens - 1]).all():
                raise RuntimeError("non-finite logits")
            out.append(tok)
            llm.eval([tok])
        return {"load_seconds": round(load, 1), "prompt_tokens": len(toks), "tokens": out,
                "seconds": round(time.perf_counter() - t0 - load, 1)}
    finally:
        llm.close()


def room_and_tokenizer(out: Path, need: int, tokenizer: Path | None) -> Path | None:
    """The GGUF whose tokenizer to copy (SmolLM2-135M-Instruct's, fetched once, when None), or None
    (said on stderr) when the disk holding ``out`` has less than ``need`` bytes free."""
    free = shutil.disk_usage(out.absolute().parent).free
    if need > free:
        print(f"{out}: about {need / 1e9:.1f} GB to write, {free / 1e9:.1f} GB free", file=sys.stderr)
        return None
    if tokenizer is None:
        from leanstream_ggml.model import registry

        tokenizer = registry.fetch("smollm2-135m-instruct", progress=False)
    return Path(tokenizer)


def main(argv=None) -> int:
    ap = benchkit.parser(__doc__)
    ap.add_argument("out", type=Path, help="the GGUF to write")
    ap.add_argument("--arch", choices=("qwen3moe", "gpt-oss"), default="qwen3moe",
                    help="qwen3moe (the default: Qwen3-30B-A3B's shape) or gpt-oss (gpt-oss-20b's)")
    ap.add_argument("--layers", type=int, choices=(2, 16, 24, 48), default=None,
                    help="qwen3moe: 16 (the default, ~6.6 GB) or 48 (Qwen3-30B-A3B's depth, ~19.4 GB); "
                         "gpt-oss: 24 (the default, gpt-oss-20b's depth, ~12.0 GB); 2 for a smoke run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--routing", choices=tuple(ROUTING), default="narrow",
                    help="how the tokens route (the docstring's table): narrow (the default, as always), "
                         "calibrated (Qwen3-30B-A3B's figures) or flat (near-uniform)")
    ap.add_argument("--decode", action="store_true", help="also load it in stock llama-cpp-python and decode 4 tokens (llama.cpp repacks the K-quant "
                         "weights: ~1.5x the file's size resident)")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="the GGUF whose tokenizer to copy (default: SmolLM2-135M-Instruct, fetched once)")
    a = ap.parse_args(argv)
    if a.layers is None:
        a.layers = GPT_OSS["n_layer"] if a.arch == "gpt-oss" else 16
    tokenizer = room_and_tokenizer(a.out, expected_bytes(a.layers, arch=a.arch), a.tokenizer)
    if tokenizer is None:
        return 1
    t0 = time.perf_counter()
    shape = write_model(a.out, a.layers, tokenizer, a.seed, a.routing, a.arch)
    seconds = time.perf_counter() - t0
    check_layout(a.out, shape)
    doc = {"path": str(a.out), "bytes": a.out.stat().st_size, "seconds": round(seconds, 1),
           "tokenizer": Path(tokenizer).name, **shape}
    if a.decode:
        doc["decode"] = decode(a.out)
    return benchkit.emit(doc)


if __name__ == "__main__":
    sys.exit(main())
