"""A Qwen3-30B-A3B-shaped mixture-of-experts GGUF for the MoE benchmarks, written one tensor at a time.

    python bench/moe_synth.py /data/qwen3moe-16l.gguf --layers 16     # ~6.6 GB
    python bench/moe_synth.py /data/qwen3moe-48l.gguf --layers 48     # the whole model's depth, ~19.4 GB
    python bench/moe_synth.py /tmp/qwen3moe-2l.gguf --layers 2 --decode   # a smoke run, decoded by stock llama.cpp
    python bench/moe_synth.py /data/qwen3moe-16l-cal.gguf --routing calibrated   # routes like Qwen3-30B-A3B

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


def embedding_chunks(W: Writer, seed: int, sub: int, rows: int, knobs: dict):
    """token_embd of the calibrated/flat modes, Q8_0 (gguf-py quantizes): each row emb_scale *
    (shared * u + (1 - shared^2)^0.5 * r), u one unit-RMS zero-sum direction common to every token
    (a popularity bias in every layer's router logits), r the token's own N(0, 1) row."""
    gguf = W.gguf
    u = shared_direction(seed, sub)

    def chunks():
        r = np.random.default_rng([seed, sub])
        a = knobs["shared"]
        for first in range(0, rows, CHUNK_ROWS):
            x = r.standard_normal((min(CHUNK_ROWS, rows - first), N_EMBD)) * (1 - a * a) ** 0.5 + a * u
            yield gguf.quants.quantize((x * knobs["emb_scale"]).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    return chunks


def shared_direction(seed: int, sub: int) -> np.ndarray:
    """u of embedding_chunks: unit RMS, zero sum."""
    u = np.random.default_rng([seed, sub, 0]).standard_normal(N_EMBD)
    u -= u.mean()
    return u / np.sqrt((u ** 2).mean())


def popular_direction(W: Writer, knobs: dict, u: np.ndarray, v_chunks, o_chunks) -> np.ndarray:
    """The unit direction every token's FFN input shares (calibrated/flat): the embeddings'
    emb_scale * shared * u plus what layer 0's attention makes of it, W_o (W_v shared * u) (the
    attention weights sum to 1; each query head reads key/value head h // 8)."""
    gguf = W.gguf
    deq = lambda chunks, t, cols: np.concatenate([gguf.quants.dequantize(c, gguf.GGMLQuantizationType[t]) for c in chunks()]).reshape(-1, cols)
    vu = deq(v_chunks, TYPES["attn_v"], N_EMBD) @ (knobs["shared"] * u)                     # [n_head_kv * head_dim]
    heads = vu.reshape(N_HEAD_KV, HEAD_DIM)[np.arange(N_HEAD) // (N_HEAD // N_HEAD_KV)].reshape(-1)
    c = knobs["emb_scale"] * knobs["shared"] * u + deq(o_chunks, TYPES["attn_output"], N_HEAD * HEAD_DIM) @ heads
    return c / np.linalg.norm(c)


def norm_gains(seed: int, il: int, sigma: float) -> np.ndarray | None:
    """Layer il's ffn_norm weight (calibrated/flat): per channel exp(sigma N(0, 1)), a fresh draw
    per layer (its own stream, [seed, 0, il]), scaled to RMS 1; None when sigma is 0 (all ones)."""
    if not sigma:
        return None
    g = np.exp(sigma * np.random.default_rng([seed, 0, il]).standard_normal(N_EMBD))
    return (g / np.sqrt((g ** 2).mean())).astype(np.float32)


def write_model(path: Path, n_layer: int, tokenizer: Path, seed: int = 0, routing: str | dict = "narrow") -> dict:
    """The GGUF at ``path`` (written as path + ".partial", then renamed); its shape as a dict.
    ``routing``: a ROUTING mode's name, or its knobs as a dict."""
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
    return {"n_layer": n_layer, "n_embd": N_EMBD, "n_head": N_HEAD, "n_head_kv": N_HEAD_KV, "head_dim": HEAD_DIM,
            "n_expert": N_EXPERT, "n_expert_used": N_EXPERT_USED, "n_ff_exp": N_FF_EXP, "n_vocab": n_vocab,
            "types": types, "routing": routing if isinstance(routing, str) else knobs, "tensors": len(W.plan)}


def expected_bytes(n_layer: int, n_vocab: int = 49152) -> int:
    """About what the file takes (the tensor data; the header is a few MB)."""
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
    """gguf-py reads it back: every tensor where its info says, the expert count and types as written."""
    r, t = read_layout(path, shape["tensors"])
    g = t["blk.0.ffn_gate_exps.weight"]
    assert [int(x) for x in g.shape] == [N_EMBD, N_FF_EXP, N_EXPERT] and g.tensor_type.name == TYPES["ffn_gate_exps"]
    assert t["blk.0.ffn_down_exps.weight"].tensor_type.name == TYPES["ffn_down_exps"]
    assert r.get_field("qwen3moe.expert_count").contents() == N_EXPERT


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
    ap.add_argument("--layers", type=int, choices=(2, 16, 48), default=16,
                    help="16 (~6.6 GB) or 48 (Qwen3-30B-A3B's depth, ~19.4 GB); 2 for a smoke run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--routing", choices=tuple(ROUTING), default="narrow",
                    help="how the tokens route (the docstring's table): narrow (the default, as always), "
                         "calibrated (Qwen3-30B-A3B's figures) or flat (near-uniform)")
    ap.add_argument("--decode", action="store_true", help="also load it in stock llama-cpp-python and decode 4 tokens (llama.cpp repacks the K-quant "
                         "weights: ~1.5x the file's size resident)")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="the GGUF whose tokenizer to copy (default: SmolLM2-135M-Instruct, fetched once)")
    a = ap.parse_args(argv)
    tokenizer = room_and_tokenizer(a.out, expected_bytes(a.layers), a.tokenizer)
    if tokenizer is None:
        return 1
    t0 = time.perf_counter()
    shape = write_model(a.out, a.layers, tokenizer, a.seed, a.routing)
    seconds = time.perf_counter() - t0
    check_layout(a.out, shape)
    doc = {"path": str(a.out), "bytes": a.out.stat().st_size, "seconds": round(seconds, 1),
           "tokenizer": Path(tokenizer).name, **shape}
    if a.decode:
        doc["decode"] = decode(a.out)
    return benchkit.emit(doc)


if __name__ == "__main__":
    sys.exit(main())
