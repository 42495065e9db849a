"""Tiny synthetic GGUFs of the hybrid recurrent mixture-of-experts architectures, for tests, written
with gguf-py (names from gguf.TENSOR_NAMES / gguf.Keys, the GGUFWriter's add_* helpers).

    from moe_hybrids import write_hybrid         # (tests/conftest.py puts tests/support/ on sys.path)
    info = write_hybrid(tmp_path / "q3n.gguf", "qwen3next", expert_type="Q8_0", seed=0)
    info["moe_layers"], info["recurrent_layers"]  # which blocks hold ffn_*_exps, which are recurrent
    info["tensors"]["blk.0.ffn_up_exps.weight"]   # float32 [n_expert, n_ff_exp, n_embd]: the values held

Architectures (``HYBRIDS``), each in the tensor layout and with the metadata its llama.cpp loader and
graph take (load_arch_hparams / load_arch_tensors of the file named):

    qwen3next       src/models/qwen3next.cpp. Gated DeltaNet layers (attn_qkv, attn_gate, ssm_conv1d,
                    ssm_dt.bias, ssm_a, ssm_ba, ssm_norm, ssm_out) and, every full_attention_interval-th
                    layer, gated full attention (attn_q twice the heads: query + gate, attn_k/v,
                    attn_q_norm/attn_k_norm per head); attn_norm, post_attention_norm (the FFN's norm);
                    every layer MoE: softmax router, normalized top-k, ffn_{gate,up,down}_exps (or the
                    fused ffn_gate_up_exps) plus a shared expert gated by sigmoid(ffn_gate_inp_shexp . x)
    qwen35moe       src/models/qwen35moe.cpp. qwen3next's layout, but the DeltaNet's beta and alpha are
                    separate ssm_beta / ssm_alpha, and rope is interleaved multi-section (IMROPE:
                    qwen35moe.rope.dimension_sections, required)
    lfm2moe         src/models/lfm2moe.cpp (graph: src/models/lfm2.cpp). Short-convolution layers
                    (shortconv.{conv,in_proj,out_proj}; a layer is one iff its head_count_kv entry is 0)
                    and attention layers (q/k norms); leading_dense_block_count dense layers
                    (ffn_{gate,up,down}), then MoE: sigmoid router (expert_gating_func, required) with
                    exp_probs_b.bias, no shared expert; the final norm is token_embd_norm, the output
                    tied to token_embd
    nemotron_h_moe  src/models/nemotron-h.cpp (graph: src/models/nemotron-h-moe.cpp). One mixer per
                    block: Mamba-2 (ssm_in, ssm_conv1d + bias, ssm_dt.bias, ssm_a, ssm_d, grouped ssm_norm,
                    ssm_out; head_count_kv and feed_forward_length entries both 0), attention without
                    rope (head_count_kv > 0, feed_forward_length 0) or MoE (feed_forward_length > 0):
                    ungated ReLU^2 experts ffn_up_exps / ffn_down_exps only, sigmoid router with
                    exp_probs_b.bias, an ungated ReLU^2 shared expert ffn_{up,down}_shexp. A layout
                    leanstream's converter refuses (no gate); it only has to load in llama.cpp

The layer pattern per arch (``layer_kinds``; n_layer defaults to 4 for every arch):
    qwen3next / qwen35moe   recurrent unless (il + 1) % full_attention_interval == 0 (default 2:
                            R A R A; the key is always written); every layer MoE
    lfm2moe                 even layers shortconv, odd layers attention (C A C A); the first
                            ``n_dense_lead`` (default 1) dense, the rest MoE
    nemotron_h_moe          "M E * E" repeated: Mamba-2, MoE, attention, MoE

``mtp=True`` (qwen3next, qwen35moe, nemotron_h_moe) appends one multi-token-prediction block
(nextn_predict_layers = 1; block_count counts it): a full-attention block with its own routed
experts and shared expert, plus nextn.{eh_proj,enorm,hnorm} (nemotron: and nextn.shared_head_norm).
llama.cpp loads it only with load_mtp (otherwise the tensors are skipped) and never runs it in the
trunk graph; its ffn_*_exps are in the file all the same.

Weights are random as in gguf_synth (its byte-level "gpt2" vocabulary of 267 tokens, _weights(), its
scales): ``scales="peaked"`` (default; a dict of roles "embd", "attn", "ffn", "output", "router",
"shexp" as gguf_synth's, or None for its DEFAULT_SCALES) gives peaked next-token distributions in
which the routed experts decide the next token (another expert_seed changes the argmax at 75-100%
of positions); the shared expert ("shexp") has half the experts' scale so that it does not. Matrices
are F16, norms, biases, the router, ssm_a / ssm_d / the conv kernels F32, the routed experts
``expert_type`` (F16, Q8_0 or Q4_0). The routed experts' weights come from their own generator,
seeded by ``expert_seed`` (default ``seed``): two files that differ only in expert_seed hold the same
everything else. The MTP block draws from generators of its own too: with mtp=True the trunk is
the file's without, and decodes to the same logits. ``fused_gate_up=True`` (qwen3next, qwen35moe)
writes the same gate and up values as one ffn_gate_up_exps [n_expert, 2 n_ff_exp, n_embd], each
expert's gate rows first (build_moe_ffn's split): the fused file computes what the unfused one does.

The files load in llama.cpp (llama-cpp-python 0.3.36; tests/unit/test_moe_hybrids.py: each loads,
llama_model_is_hybrid() true and llama_model_is_recurrent() false, decodes 16 tokens to finite
logits, its routed experts decide the next token, fused == unfused, an MTP block changes nothing in
the trunk; the MTP blocks also load with llama_model_params.load_mtp, shapes checked).
"""

from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np
from gguf import MODEL_TENSOR as MT
from gguf_synth import DEFAULT_SCALES, PEAKED, _qtype, _weights, add_vocab, gpt2_vocab, tiny_writer

HYBRIDS = ("qwen3next", "qwen35moe", "lfm2moe", "nemotron_h_moe")
FUSABLE = ("qwen3next", "qwen35moe")            # loaders that accept ffn_gate_up_exps (create_tensor_gate_up_exps)
MTP_ARCHS = ("qwen3next", "qwen35moe", "nemotron_h_moe")
EXPERT_TYPES = ("F16", "Q8_0", "Q4_0")
_NEMOTRON_PATTERN = "ME*E"                      # Mamba-2, MoE, attention, MoE (Nemotron-H's hybrid_override_pattern)

# the small hyperparameters each arch is written with
N_HEAD, N_HEAD_KV, HEAD_DIM = 4, 2, 16          # attention (qwen: q has 2 * N_HEAD * HEAD_DIM rows: query + gate)
QWEN_ROT = 8                                    # rope on part of each head only (Qwen3-Next: a quarter)
QWEN35_SECTIONS = [2, 1, 1, 0]                  # IMROPE sections, summing to QWEN_ROT / 2
DELTANET = {"d_conv": 4, "d_state": 16, "n_group": 2, "dt_rank": 4}    # k head dim, k heads, v heads
MAMBA2 = {"d_conv": 4, "d_state": 16, "n_group": 1, "dt_rank": 4}      # n_head = dt_rank, d_inner = 2 n_embd
LFM2_L_CACHE = 3
# scales="peaked" per arch, over gguf_synth.PEAKED: lfm2moe's experts at twice the scale (with
# PEAKED's, behind its dense first layer and the output tied to the embeddings, other experts change
# the next token at only ~45% of positions; with these, at ~90%)
PEAKED_ARCH = {"lfm2moe": {"ffn": 0.3}}


def layer_kinds(arch: str, n_layer: int, full_attention_interval: int = 2) -> list[str]:
    """The trunk's mixer per layer: "recurrent", "attention" or (nemotron_h_moe) "moe"."""
    if arch in ("qwen3next", "qwen35moe"):
        return ["attention" if (il + 1) % full_attention_interval == 0 else "recurrent" for il in range(n_layer)]
    if arch == "lfm2moe":
        return ["attention" if il % 2 else "recurrent" for il in range(n_layer)]
    if arch == "nemotron_h_moe":
        return [{"M": "recurrent", "E": "moe", "*": "attention"}[_NEMOTRON_PATTERN[il % 4]] for il in range(n_layer)]
    raise ValueError(f"arch must be one of {', '.join(HYBRIDS)}, got {arch!r}")


def _name(t: MT, il: int | None = None, suffix: str | None = "weight") -> str:
    n = gguf.TENSOR_NAMES[t].format(bid=il)
    return f"{n}.{suffix}" if suffix else n


def write_hybrid(path: str | os.PathLike, arch: str, *, n_layer: int | None = None, n_embd: int = 64,
                 n_expert: int = 8, n_used: int = 2, n_ff_exp: int = 64, seed: int = 0,
                 expert_type: str = "Q8_0", fused_gate_up: bool = False, scales: str | dict | None = "peaked",
                 expert_seed: int | None = None, mtp: bool = False, full_attention_interval: int = 2,
                 n_dense_lead: int = 1, n_ff: int = 96, n_ff_shexp: int | None = None,
                 n_ctx: int = 256) -> dict[str, Any]:
    """Write a tiny random ``arch`` model at ``path``. Returns {"arch", "n_layer" (trunk layers),
    "block_count" (with the MTP block), "layer_kinds" (per block, the MTP one "mtp"), "moe_layers"
    (every block holding ffn_*_exps, the MTP block included), "dense_layers" (blocks with a dense
    ffn_gate/up/down), "recurrent_layers", "attention_layers", "mtp_layers", "n_expert", "n_used",
    "n_ff_exp", "n_embd", "n_ff_shexp", "expert_type", "fused_gate_up", "expert_tensors" ({il: names of
    its ffn_*_exps}), "tensors" ({name: float32 values as stored, shaped as numpy sees the file:
    [ne1, ne0], experts [n_expert, ne1, ne0]})}.
    ``n_ff``: lfm2moe's dense layers' size; ``n_ff_shexp``: the shared expert's (default n_ff_exp)."""
    if arch not in HYBRIDS:
        raise ValueError(f"arch must be one of {', '.join(HYBRIDS)}, got {arch!r}")
    if str(expert_type).upper() not in EXPERT_TYPES:
        raise ValueError(f"expert_type must be one of {', '.join(EXPERT_TYPES)}, got {expert_type!r}")
    if fused_gate_up and arch not in FUSABLE:
        raise ValueError(f"fused_gate_up: {arch}'s loader takes no ffn_gate_up_exps (only {', '.join(FUSABLE)})")
    if mtp and arch not in MTP_ARCHS:
        raise ValueError(f"mtp: {arch} has no multi-token-prediction block (only {', '.join(MTP_ARCHS)})")
    if not 0 < n_used <= n_expert:
        raise ValueError(f"n_used must be in 1..{n_expert}, got {n_used}")
    n_layer = 4 if n_layer is None else n_layer
    kinds = layer_kinds(arch, n_layer, full_attention_interval)
    if "recurrent" not in kinds or "attention" not in kinds:
        raise ValueError(f"{arch} with {n_layer} layers: {kinds} has no recurrent or no attention layer")
    if arch == "lfm2moe" and not 0 <= n_dense_lead < n_layer:
        raise ValueError(f"n_dense_lead must be in 0..{n_layer - 1}, got {n_dense_lead}")
    n_ff_shexp = n_ff_shexp or n_ff_exp
    etype = _qtype(expert_type)
    n_mtp = 1 if mtp else 0
    block_count = n_layer + n_mtp

    sc = dict(DEFAULT_SCALES)
    if scales == "peaked":
        sc.update({**PEAKED, **PEAKED_ARCH.get(arch, {})})
        for role in ("ffn", "output"):          # (PEAKED's are for n_embd 64: a dot product grows as its root)
            sc[role] *= (64 / n_embd) ** 0.5
        if arch == "lfm2moe":                   # the output is token_embd
            sc["embd"] = sc["output"]
    elif isinstance(scales, dict):
        sc.update(scales)
    sc.setdefault("router", 2.0 / n_embd ** 0.5)
    sc.setdefault("shexp", sc["ffn"] / 2)

    # the generators: the trunk's (and the output's), the routed experts'; the MTP block draws from its
    # own pair, so that a file with it holds the same trunk as one without
    e_seed = seed if expert_seed is None else expert_seed
    trunk_gens = (np.random.default_rng(seed), np.random.default_rng([e_seed, 0x5EED]))
    mtp_gens = (np.random.default_rng([seed, 0x317]), np.random.default_rng([e_seed, 0x5EED, 0x317]))
    gens = list(trunk_gens)
    n_vocab = len(gpt2_vocab()[0])

    w = tiny_writer(path, arch, n_ctx=n_ctx, n_embd=n_embd, block_count=block_count)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(1)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_used)
    w.add_expert_feed_forward_length(n_ff_exp)
    if mtp:
        w.add_nextn_predict_layers(n_mtp)

    # every block's kind, the MTP block a full-attention one
    all_kinds = kinds + ["mtp"] * n_mtp
    if arch in ("qwen3next", "qwen35moe"):
        w.add_feed_forward_length(n_ff_shexp)
        w.add_expert_shared_feed_forward_length(n_ff_shexp)
        w.add_head_count(N_HEAD)
        w.add_head_count_kv(N_HEAD_KV)
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
        w.add_rope_dimension_count(QWEN_ROT)
        w.add_rope_freq_base(10000.0)
        if arch == "qwen35moe":
            w.add_rope_dimension_sections(QWEN35_SECTIONS)
        w.add_full_attention_interval(full_attention_interval)
        d = DELTANET
        w.add_ssm_conv_kernel(d["d_conv"])
        w.add_ssm_state_size(d["d_state"])
        w.add_ssm_group_count(d["n_group"])
        w.add_ssm_time_step_rank(d["dt_rank"])
        w.add_ssm_inner_size(d["d_state"] * d["dt_rank"])   # value_dim: the v heads are d_state wide
    elif arch == "lfm2moe":
        if n_embd % N_HEAD:
            raise ValueError(f"lfm2moe: n_embd must be a multiple of {N_HEAD}")
        w.add_feed_forward_length(n_ff)
        w.add_head_count(N_HEAD)                 # head size n_embd / N_HEAD; q and output are [n_embd, n_embd]
        w.add_head_count_kv([N_HEAD_KV if k == "attention" else 0 for k in kinds])    # 0: a shortconv layer
        w.add_rope_freq_base(10000.0)
        w.add_shortconv_l_cache(LFM2_L_CACHE)
        w.add_leading_dense_block_count(n_dense_lead)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    else:                                        # nemotron_h_moe
        if n_embd % N_HEAD:
            raise ValueError(f"nemotron_h_moe: n_embd must be a multiple of {N_HEAD}")
        # a block is Mamba-2 iff its head_count_kv and feed_forward_length entries are both 0, MoE iff
        # its feed_forward_length is not 0; the MTP block needs its heads
        w.add_head_count(N_HEAD)
        w.add_head_count_kv([N_HEAD_KV if k in ("attention", "mtp") else 0 for k in all_kinds])
        w.add_feed_forward_length([n_ff_exp if k == "moe" else 0 for k in all_kinds])
        w.add_layer_norm_eps(1e-5)               # required (the MTP head's LayerNorm)
        w.add_expert_shared_feed_forward_length(n_ff_shexp)
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(1.0)
        m = MAMBA2
        w.add_ssm_conv_kernel(m["d_conv"])
        w.add_ssm_state_size(m["d_state"])
        w.add_ssm_group_count(m["n_group"])
        w.add_ssm_time_step_rank(m["dt_rank"])
        w.add_ssm_inner_size(2 * n_embd)

    add_vocab(w, chat_template=False)

    out: dict[str, np.ndarray] = {}
    F16, F32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32

    def add(name: str, rows: int, cols: int, scale: float, qtype=F16) -> None:
        """A matrix of ``rows`` rows of ``cols`` values (ggml ne {cols, rows})."""
        stored, values = _weights(gens[0], _qtype(qtype), rows, cols, scale)
        w.add_tensor(name, stored, raw_dtype=_qtype(qtype))
        out[name] = values

    def add_f32(name: str, shape: tuple[int, ...], value: float | None = None, std: float = 0.02,
                low: float | None = None, high: float | None = None) -> None:
        if value is not None:
            v = np.full(shape, value, np.float32)
        elif low is not None:
            v = gens[0].uniform(low, high, size=shape).astype(np.float32)
        else:
            v = (gens[0].standard_normal(shape) * std).astype(np.float32)
        w.add_tensor(name, v)
        out[name] = v

    expert_tensors: dict[int, list[str]] = {}

    def experts(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
        stored, values = _weights(gens[1], etype, n_expert * rows, cols, sc["ffn"])
        return stored.reshape(n_expert, rows, -1), values.reshape(n_expert, rows, cols)

    def add_experts(il: int, gated: bool) -> None:
        names = []
        if gated:
            gs, gv = experts(n_ff_exp, n_embd)
            us, uv = experts(n_ff_exp, n_embd)
            if fused_gate_up:            # [n_expert, 2 n_ff_exp, n_embd]: each expert's gate rows, then its up rows
                names.append(_name(MT.FFN_GATE_UP_EXP, il))
                w.add_tensor(names[-1], np.concatenate([gs, us], axis=1), raw_dtype=etype)
                out[names[-1]] = np.concatenate([gv, uv], axis=1)
            else:
                for t, s, v in ((MT.FFN_GATE_EXP, gs, gv), (MT.FFN_UP_EXP, us, uv)):
                    names.append(_name(t, il))
                    w.add_tensor(names[-1], s, raw_dtype=etype)
                    out[names[-1]] = v
        else:                            # nemotron: up only
            us, uv = experts(n_ff_exp, n_embd)
            names.append(_name(MT.FFN_UP_EXP, il))
            w.add_tensor(names[-1], us, raw_dtype=etype)
            out[names[-1]] = uv
        ds, dv = experts(n_embd, n_ff_exp)
        names.append(_name(MT.FFN_DOWN_EXP, il))
        w.add_tensor(names[-1], ds, raw_dtype=etype)
        out[names[-1]] = dv
        expert_tensors[il] = names

    def add_router(il: int) -> None:
        spread = np.linspace(0.5, 1.5, n_expert, dtype=np.float32)[gens[0].permutation(n_expert)]
        router = (gens[0].standard_normal((n_expert, n_embd)) * sc["router"]).astype(np.float32) * spread[:, None]
        w.add_tensor(_name(MT.FFN_GATE_INP, il), router)        # F32, as llama-quantize leaves it
        out[_name(MT.FFN_GATE_INP, il)] = router

    def add_qwen_attention(il: int) -> None:
        add(_name(MT.ATTN_Q, il), 2 * N_HEAD * HEAD_DIM, n_embd, sc["attn"])   # query and gate, per head
        add(_name(MT.ATTN_K, il), N_HEAD_KV * HEAD_DIM, n_embd, sc["attn"])
        add(_name(MT.ATTN_V, il), N_HEAD_KV * HEAD_DIM, n_embd, sc["attn"])
        add(_name(MT.ATTN_OUT, il), n_embd, N_HEAD * HEAD_DIM, sc["attn"])
        add_f32(_name(MT.ATTN_Q_NORM, il), (HEAD_DIM,), 1.0)
        add_f32(_name(MT.ATTN_K_NORM, il), (HEAD_DIM,), 1.0)

    def add_qwen_block(il: int, kind: str) -> None:
        add_f32(_name(MT.ATTN_NORM, il), (n_embd,), 1.0)
        add_f32(_name(MT.ATTN_POST_NORM, il), (n_embd,), 1.0)      # the FFN's input norm
        if kind == "recurrent":          # gated DeltaNet
            d = DELTANET
            key_dim, value_dim = d["d_state"] * d["n_group"], d["d_state"] * d["dt_rank"]
            add(_name(MT.ATTN_QKV, il), 2 * key_dim + value_dim, n_embd, sc["attn"])
            add(_name(MT.ATTN_GATE, il), value_dim, n_embd, sc["attn"])           # z
            add_f32(_name(MT.SSM_CONV1D, il), (2 * key_dim + value_dim, d["d_conv"]), std=0.3)
            add_f32(_name(MT.SSM_DT, il, "bias"), (d["dt_rank"],), std=0.5)
            add_f32(_name(MT.SSM_A, il, None), (d["dt_rank"],), low=-2.0, high=-0.5)   # -exp(A_log)
            if arch == "qwen3next":
                add(_name(MT.SSM_BETA_ALPHA, il), 2 * d["dt_rank"], n_embd, sc["attn"])
            else:
                add(_name(MT.SSM_BETA, il), d["dt_rank"], n_embd, sc["attn"])
                add(_name(MT.SSM_ALPHA, il), d["dt_rank"], n_embd, sc["attn"])
            add_f32(_name(MT.SSM_NORM, il), (d["d_state"],), 1.0)
            add(_name(MT.SSM_OUT, il), n_embd, value_dim, sc["attn"])
        else:
            add_qwen_attention(il)
        add_router(il)
        add_experts(il, gated=True)
        add_f32(_name(MT.FFN_GATE_INP_SHEXP, il), (n_embd,), std=sc["router"])
        add(_name(MT.FFN_GATE_SHEXP, il), n_ff_shexp, n_embd, sc["shexp"])
        add(_name(MT.FFN_UP_SHEXP, il), n_ff_shexp, n_embd, sc["shexp"])
        add(_name(MT.FFN_DOWN_SHEXP, il), n_embd, n_ff_shexp, sc["shexp"])

    def add_nextn(il: int) -> None:
        add(_name(MT.NEXTN_EH_PROJ, il), n_embd, 2 * n_embd, sc["attn"])
        add_f32(_name(MT.NEXTN_ENORM, il), (n_embd,), 1.0)
        add_f32(_name(MT.NEXTN_HNORM, il), (n_embd,), 1.0)

    add("token_embd.weight", n_vocab, n_embd, sc["embd"])
    moe_layers, dense_layers = [], []
    if arch in ("qwen3next", "qwen35moe"):
        for il, kind in enumerate(all_kinds):
            gens[:] = mtp_gens if kind == "mtp" else trunk_gens
            add_qwen_block(il, "attention" if kind == "mtp" else kind)
            moe_layers.append(il)
            if kind == "mtp":
                add_nextn(il)
        gens[:] = trunk_gens
        add_f32(_name(MT.OUTPUT_NORM), (n_embd,), 1.0)
        add(_name(MT.OUTPUT), n_vocab, n_embd, sc["output"])
    elif arch == "lfm2moe":
        for il, kind in enumerate(kinds):
            add_f32(_name(MT.ATTN_NORM, il), (n_embd,), 1.0)          # the mixer's norm ("operator_norm")
            if kind == "attention":
                add(_name(MT.ATTN_Q, il), n_embd, n_embd, sc["attn"])
                add(_name(MT.ATTN_K, il), N_HEAD_KV * (n_embd // N_HEAD), n_embd, sc["attn"])
                add(_name(MT.ATTN_V, il), N_HEAD_KV * (n_embd // N_HEAD), n_embd, sc["attn"])
                add(_name(MT.ATTN_OUT, il), n_embd, n_embd, sc["attn"])
                add_f32(_name(MT.ATTN_Q_NORM, il), (n_embd // N_HEAD,), 1.0)
                add_f32(_name(MT.ATTN_K_NORM, il), (n_embd // N_HEAD,), 1.0)
            else:                        # shortconv: in_proj to B, C, x; a depthwise conv of L_cache taps
                add_f32(_name(MT.SHORTCONV_CONV, il), (n_embd, LFM2_L_CACHE), std=0.5)
                add(_name(MT.SHORTCONV_INPROJ, il), 3 * n_embd, n_embd, sc["attn"] * 4)
                add(_name(MT.SHORTCONV_OUTPROJ, il), n_embd, n_embd, sc["attn"] * 4)
            add_f32(_name(MT.FFN_NORM, il), (n_embd,), 1.0)
            if il < n_dense_lead:
                dense_layers.append(il)
                add(_name(MT.FFN_GATE, il), n_ff, n_embd, sc["ffn"])
                add(_name(MT.FFN_UP, il), n_ff, n_embd, sc["ffn"])
                add(_name(MT.FFN_DOWN, il), n_embd, n_ff, sc["ffn"])
            else:
                moe_layers.append(il)
                add_router(il)
                add_f32(_name(MT.FFN_EXP_PROBS_B, il, "bias"), (n_expert,), std=0.1)
                add_experts(il, gated=True)
        add_f32(_name(MT.TOKEN_EMBD_NORM), (n_embd,), 1.0)          # llama.cpp's LLM_TENSOR_OUTPUT_NORM_LFM2
    else:                                # nemotron_h_moe
        m = MAMBA2
        d_inner = 2 * n_embd
        conv_ch = d_inner + 2 * m["n_group"] * m["d_state"]
        hd = n_embd // N_HEAD

        def add_moe(il: int) -> None:
            add_router(il)
            add_f32(_name(MT.FFN_EXP_PROBS_B, il, "bias"), (n_expert,), std=0.1)
            add_experts(il, gated=False)
            add(_name(MT.FFN_UP_SHEXP, il), n_ff_shexp, n_embd, sc["shexp"])
            add(_name(MT.FFN_DOWN_SHEXP, il), n_embd, n_ff_shexp, sc["shexp"])

        def add_attention(il: int) -> None:
            add(_name(MT.ATTN_Q, il), N_HEAD * hd, n_embd, sc["attn"])
            add(_name(MT.ATTN_K, il), N_HEAD_KV * hd, n_embd, sc["attn"])
            add(_name(MT.ATTN_V, il), N_HEAD_KV * hd, n_embd, sc["attn"])
            add(_name(MT.ATTN_OUT, il), n_embd, N_HEAD * hd, sc["attn"])

        for il, kind in enumerate(all_kinds):
            gens[:] = mtp_gens if kind == "mtp" else trunk_gens
            add_f32(_name(MT.ATTN_NORM, il), (n_embd,), 1.0)
            if kind == "recurrent":      # Mamba-2: in_proj to z, xBC, dt
                add(_name(MT.SSM_IN, il), 2 * d_inner + 2 * m["n_group"] * m["d_state"] + m["dt_rank"], n_embd,
                    sc["attn"] * 4)
                add_f32(_name(MT.SSM_CONV1D, il), (conv_ch, m["d_conv"]), std=0.3)
                add_f32(_name(MT.SSM_CONV1D, il, "bias"), (conv_ch,), std=0.1)
                add_f32(_name(MT.SSM_DT, il, "bias"), (m["dt_rank"],), std=0.5)
                add_f32(_name(MT.SSM_A, il, None), (m["dt_rank"], 1), low=-2.0, high=-0.5)
                add_f32(_name(MT.SSM_D, il, None), (m["dt_rank"], 1), 1.0)
                add_f32(_name(MT.SSM_NORM, il), (m["n_group"], d_inner // m["n_group"]), 1.0)
                add(_name(MT.SSM_OUT, il), n_embd, d_inner, sc["attn"] * 4)
            elif kind == "attention":
                add_attention(il)
            elif kind == "moe":
                moe_layers.append(il)
                add_moe(il)
            else:                        # the MTP block: attention and MoE sub-layers in one block
                add_nextn(il)
                add_f32(_name(MT.NEXTN_SHARED_HEAD_NORM, il), (n_embd,), 1.0)
                add_attention(il)
                add_f32(_name(MT.ATTN_POST_NORM, il), (n_embd,), 1.0)
                moe_layers.append(il)
                add_moe(il)
        gens[:] = trunk_gens
        add_f32(_name(MT.OUTPUT_NORM), (n_embd,), 1.0)
        add(_name(MT.OUTPUT), n_vocab, n_embd, sc["output"])

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {
        "arch": arch, "n_layer": n_layer, "block_count": block_count, "layer_kinds": all_kinds,
        "moe_layers": moe_layers, "dense_layers": dense_layers,
        "recurrent_layers": [il for il, k in enumerate(kinds) if k == "recurrent"],
        "attention_layers": [il for il, k in enumerate(all_kinds) if k in ("attention", "mtp")],
        "mtp_layers": list(range(n_layer, block_count)),
        "n_expert": n_expert, "n_used": n_used, "n_ff_exp": n_ff_exp, "n_embd": n_embd, "n_ff_shexp": n_ff_shexp,
        "expert_type": etype.name, "fused_gate_up": fused_gate_up, "expert_tensors": expert_tensors,
        "tensors": out,
    }
