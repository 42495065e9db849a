"""Tiny synthetic GGUFs of more mixture-of-experts families, for tests, written with gguf-py.

    from moe_families import FAMILIES, write_family     # (tests/conftest.py puts tests/support/ on sys.path)
    info = write_family(tmp_path / "glm.gguf", "glm4moe", nextn=1, seed=0)
    info["moe_layers"], info["dense_layers"], info["mtp_layers"]    # [1, 2], [0], [3]
    info["expert_tensors"][1]     # the routed-expert tensors of layer 1 (what a converter moves out)
    info["tensors"]["blk.1.ffn_up_exps.weight"]   # float32 [n_expert, n_ff_exp, n_embd], as stored

Each family in the tensor names, shapes and metadata its llama.cpp loader requires
(src/models/<file>.cpp: load_arch_hparams / load_arch_tensors, and the graph), names from gguf-py's
tables (gguf.TENSOR_NAMES, gguf.Keys). Defaults (n_layer=None) give each family's layer pattern:

    gpt-oss       src/models/openai-moe.cpp. 2 layers, every one MoE. attn_q/k/v + biases, attn_output +
                  bias, attn_sinks [n_head], post_attention_norm (the FFN's pre-norm); ffn_gate_inp +
                  .bias [E]; ffn_{gate,up,down}_exps MXFP4 each with a per-expert .bias ([E, n_ff_exp],
                  [E, n_ff_exp], [E, n_embd]); SwiGLU-OAI, softmax over the top-k logits. Required keys:
                  expert_feed_forward_length, attention.sliding_window (even layers sliding, pattern 2)
    glm4moe       src/models/glm4-moe.cpp. 3 trunk layers (leading_dense_block_count 1: layer 0 dense
                  ffn_gate/up/down) + ``nextn`` MTP layers (0 or 1, default 0), appended (block_count
                  counts them). attn_q/k/v + biases, post_attention_norm (FFN pre-norm), partial rope
                  (half the head).
                  MoE: ffn_gate_inp, exp_probs_b.bias [E] (required), experts, an ungated shared expert
                  ffn_*_shexp of expert_shared_count * n_ff_exp; sigmoid, normalized. The MTP layer: a
                  whole MoE layer + nextn.{eh_proj [n_embd, 2 n_embd], enorm, hnorm, shared_head_norm}
    deepseek2     src/models/deepseek2.cpp. 3 layers, 1 leading dense. MLA as DeepSeek-V2-Lite's
                  (q_lora_rank 0: attn_q; attn_kv_a_mqa, attn_kv_a_norm, attn_k_b [H, kv_lora, nope],
                  attn_v_b [H, v, kv_lora]; head_count_kv 1), ffn_norm, softmax routing, 2 shared experts
                  (ungated). ``expert_groups=G``: DeepSeek-V3's routing (sigmoid, exp_probs_b, G groups, G/2
                  of them used, normalized). ``fused_gate_up``: ffn_gate_up_exps
    llama4        src/models/llama4.cpp. 4 layers, interleave_moe_layer_step 2 (``moe_step``): layers
                  with (il+1) % step == 0 MoE (1, 3), the others dense (n_ff); every 4th layer (3) without
                  rope (n_no_rope_layer_step), chunked attention. MoE: ffn_gate_inp, experts, shared expert
                  of n_ff_exp (ungated); sigmoid weights applied to the experts' input (weight_before_ffn)
    ernie4_5-moe  src/models/ernie4-5.cpp (tensors), ernie4-5-moe.cpp (graph). 3 layers: 1 leading dense,
                  then MoE with interleave_moe_layer_step 1 (required key; ERNIE 4.5's value). Its loader
                  makes every layer past the leading dense ones MoE whatever the step while its graph
                  runs experts only where (il + 1) % step == 0, so a step > 1 cannot run (refused here).
                  ffn_gate_inp, exp_probs_b (optional, written), experts, a shared expert of
                  expert_shared_feed_forward_length; softmax, normalized
    granitemoe    src/models/granite-moe.cpp (graph: granite.cpp). 2 layers, every one MoE; an expert's size
                  is feed_forward_length; granite's multipliers (logit_scale required); softmax, normalized
    dots1         src/models/dots1.cpp. 3 layers, 1 leading dense. No grouped-query attention (k/v are
                  n_head * head_dim), attn_q_norm / attn_k_norm required; ffn_gate_inp, exp_probs_b
                  (optional, written), experts, shared expert (expert_shared_count); expert_gating_func
                  must be written (sigmoid here: llama.cpp has no default and aborts building the graph)
    gemma4        src/models/gemma4.cpp. 2 layers (sliding_window_pattern [True, False]: sliding head 16,
                  full head 32, rope_freqs for the full layers), every one MoE: the dense MLP ffn_gate/up/
                  down (GeGLU, ffn_norm -> post_ffw_norm_1) in parallel with the experts (pre_ffw_norm_2 ->
                  experts -> post_ffw_norm_2), their sum through post_ffw_norm; ffn_gate_inp + .scale
                  [n_embd] (router on rms_norm(x) / sqrt(n_embd) * scale), ffn_down_exps.scale [E] (Gemma 4's
                  per_expert_scale), layer_output_scale [1]; GeGLU experts, softmax, normalized;
                  ``fused_gate_up``: ffn_gate_up_exps (as Gemma 4 GGUFs ship)

The routed experts are ffn_{gate,up,down}_exps.weight (or ffn_gate_up_exps.weight) and, where the family
has them, their .bias (gpt-oss) and .scale (gemma4) tensors: ``info["expert_tensors"][il]`` lists them.
``expert_seed`` draws them (and only them) from another seed: the same model with other experts.

Shared with gguf_synth: the byte-level "gpt2" vocabulary (gpt2_vocab), the random weights (_weights:
quantized by gguf-py, MXFP4 included; K-quants as random bytes), the per-role scales and the "peaked"
scales (the largest logit some units above the rest, the FFN as large as the residual stream) so that
the experts decide the next token (tests/unit/test_moe_families.py checks it: other experts move the
argmax of most positions). Norms and biases, routers and per-expert scales are F32; attention,
embeddings and the dense FFN / shared expert F16; the routed experts ``expert_type`` (default MXFP4
for gpt-oss, Q8_0 otherwise). Rows of quantized experts need multiples of 32 values (n_embd,
n_ff_exp); K-quants 256.
"""

from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import MODEL_TENSOR as MT
from gguf_synth import DEFAULT_SCALES, GRANITE_SCALES, PEAKED, PEAKED_ARCH, _qtype, _weights, add_vocab, tiny_writer

FAMILIES = ("gpt-oss", "glm4moe", "deepseek2", "llama4", "ernie4_5-moe", "granitemoe", "dots1", "gemma4")
FUSED_OK = ("gemma4", "deepseek2")   # archs whose loader takes ffn_gate_up_exps
# the routed experts' types (gguf-py quantizes these; and the K-quants, as random bytes, rows of 256)
EXPERT_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")

# per family: n_layer (trunk), leading dense layers, interleave step, shared expert (multiple of
# n_ff_exp; 0 = none)
_SPEC: dict[str, dict[str, Any]] = {
    "gpt-oss": dict(n_layer=2, lead=0, step=1, shexp=0),
    "glm4moe": dict(n_layer=3, lead=1, step=1, shexp=1),
    "deepseek2": dict(n_layer=3, lead=1, step=1, shexp=2),
    "llama4": dict(n_layer=4, lead=0, step=2, shexp=1),
    "ernie4_5-moe": dict(n_layer=3, lead=1, step=1, shexp=1),
    "granitemoe": dict(n_layer=2, lead=0, step=1, shexp=0),
    "dots1": dict(n_layer=3, lead=1, step=1, shexp=1),
    "gemma4": dict(n_layer=2, lead=0, step=1, shexp=0),
}
N_HEAD, N_HEAD_KV, HEAD_DIM = 4, 2, 16
# deepseek2's MLA: kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim
MLA = {"kv_lora_rank": 32, "rope": 16, "nope": 32, "v": 32}
GEMMA4_HEAD_FULL = 32     # gemma4's full-attention layers' head (the sliding ones: HEAD_DIM)
SLIDING_WINDOW = 8        # gpt-oss, gemma4: shorter than the tests' 16 tokens, so that the window matters


def _tn(t: MT, il: int | None = None, suffix: str = "weight") -> str:
    name = gguf.TENSOR_NAMES[t]
    return f"{name.format(bid=il) if il is not None else name}.{suffix}"


def _write_vocab(w: gguf.GGUFWriter) -> int:
    """gguf_synth's tokenizer: the byte-level BPE vocabulary and its control tokens; returns n_vocab."""
    n_vocab = add_vocab(w)
    w.add_vocab_size(n_vocab)
    return n_vocab


def write_family(path: str | os.PathLike, arch: str, *, n_layer: int | None = None, n_embd: int = 64,
                 n_expert: int = 8, n_used: int = 2, n_ff_exp: int = 64, seed: int = 0,
                 expert_type: str | T | None = None, fused_gate_up: bool = False,
                 scales: dict[str, float] | str | None = "peaked", nextn: int = 0,
                 expert_seed: int | None = None, expert_groups: int = 0, moe_step: int | None = None,
                 n_ff: int | None = None, n_ctx: int = 256) -> dict[str, Any]:
    """Write a tiny random ``arch`` model at ``path``; returns its layout:

    {"arch", "n_layer" (trunk layers), "block_count" (n_layer + MTP layers), "moe_layers",
     "dense_layers", "mtp_layers", "n_expert", "n_used", "n_ff_exp", "n_ff" (dense FFN), "n_ff_shexp",
     "n_embd", "expert_type", "fused_gate_up", "expert_tensors" ({il: names of the routed-expert
     tensors}, MTP layers included), "tensors" ({name: float32 values as stored, [ne1, ne0] /
     [n_expert, ne1, ne0] / [ne0]})}.

    ``nextn``: glm4moe's MTP layers (0 or 1; GLM-4.5's GGUFs carry 1). ``expert_seed``: the seed of
    the routed experts alone (default ``seed``). ``expert_groups``: deepseek2 only (see the module
    docstring). ``moe_step``: llama4's interleave_moe_layer_step (ernie4_5-moe: 1 only, see the
    module docstring). ``n_ff``: the dense FFN's size (default 2 * n_ff_exp). ``scales``: "peaked" (default) or
    gguf_synth's per-role standard deviations, plus "router" and "experts" (default: "ffn")."""
    if arch not in FAMILIES:
        raise ValueError(f"arch must be one of {', '.join(FAMILIES)}, got {arch!r}")
    spec = _SPEC[arch]
    n_layer = spec["n_layer"] if n_layer is None else n_layer
    if nextn and arch != "glm4moe":
        raise ValueError(f"nextn: only glm4moe's MTP layers are written here, not {arch}'s")
    if nextn not in (0, 1):
        raise ValueError(f"nextn must be 0 or 1 (llama.cpp's MTP graph takes one block), got {nextn}")
    if fused_gate_up and arch not in FUSED_OK:
        raise ValueError(f"fused_gate_up: {arch}'s loader does not take ffn_gate_up_exps (only {FUSED_OK})")
    if expert_groups and arch != "deepseek2":
        raise ValueError("expert_groups: deepseek2 only")
    if expert_groups and (expert_groups < 2 or n_expert % expert_groups or n_expert // expert_groups < 2):
        raise ValueError(f"expert_groups must divide n_expert into groups of at least 2, got {expert_groups}")
    if not 0 < n_used <= n_expert:
        raise ValueError(f"n_used must be in 1..{n_expert}, got {n_used}")
    etype = _qtype(expert_type or ("MXFP4" if arch == "gpt-oss" else "Q8_0"))
    if etype.name not in EXPERT_TYPES and not etype.name.endswith("_K"):
        raise ValueError(f"expert_type must be one of {', '.join(EXPERT_TYPES)} or a K-quant, got {etype.name}")
    block = gguf.GGML_QUANT_SIZES[etype][0]
    if n_embd % block or n_ff_exp % block:
        raise ValueError(f"{etype.name} experts need n_embd and n_ff_exp multiples of {block}")
    n_ff = n_ff or 2 * n_ff_exp
    lead = spec["lead"]
    step = moe_step if moe_step is not None else spec["step"]
    if moe_step is not None and arch not in ("llama4", "ernie4_5-moe"):
        raise ValueError("moe_step: llama4 and ernie4_5-moe only")
    if arch == "ernie4_5-moe" and step != 1:
        # llama.cpp's ernie4_5-moe loader wants the experts in every layer past the leading dense ones
        # (a file with dense layers between: "check_tensor_dims: tensor 'blk.2.ffn_gate_inp.weight' not
        # found"), its graph runs them only where (il + 1) % step == 0 and gives the others an FFN
        # without weights (build_ffn with no tensors): no file of step > 1 runs correctly
        raise ValueError("ernie4_5-moe: llama.cpp runs interleave_moe_layer_step 1 only")
    if step < 1:
        raise ValueError(f"moe_step must be at least 1, got {step}")
    if lead and n_layer <= lead:
        raise ValueError(f"{arch} needs more than {lead} layer(s): the first {lead} are dense")
    n_ff_shexp = spec["shexp"] * n_ff_exp
    block_count = n_layer + nextn

    def is_moe(il: int) -> bool:
        if arch == "llama4":
            return (il + 1) % step == 0
        return il >= lead

    moe_layers = [il for il in range(block_count) if is_moe(il)]
    info: dict[str, Any] = {
        "arch": arch, "n_layer": n_layer, "block_count": block_count,
        "moe_layers": [il for il in moe_layers if il < n_layer],
        "dense_layers": [il for il in range(n_layer) if not is_moe(il)],
        "mtp_layers": list(range(n_layer, block_count)),
        "n_expert": n_expert, "n_used": n_used, "n_ff_exp": n_ff_exp, "n_ff": n_ff, "n_ff_shexp": n_ff_shexp,
        "n_embd": n_embd, "expert_type": etype.name, "fused_gate_up": fused_gate_up,
        "expert_tensors": {}, "tensors": {},
    }

    # scales (gguf_synth's roles; "peaked": PEAKED, granite's and gemma's own)
    sc = dict(DEFAULT_SCALES)
    if scales == "peaked":
        layout = {"granitemoe": "granite", "gemma4": "gemma3"}.get(arch, arch)
        sc.update({**PEAKED, **PEAKED_ARCH.get(layout, {})})
        for role in ("ffn", "output"):
            sc[role] *= (64 / n_embd) ** 0.5
        if arch == "gemma4":           # tied output: the embeddings are the output matrix
            sc["embd"] = sc["output"]
    else:
        sc.update(scales or {})
    sc.setdefault("router", 2.0 / n_embd ** 0.5)
    sc.setdefault("experts", sc["ffn"])

    rng = np.random.default_rng(seed)
    erng = np.random.default_rng([seed if expert_seed is None else expert_seed, 0x5EED])
    out = info["tensors"]
    # ---- metadata -------------------------------------------------------------------------------
    w = tiny_writer(path, arch, n_ctx=n_ctx, n_embd=n_embd, block_count=block_count)
    w.add_feed_forward_length(n_ff_exp if arch == "granitemoe" else n_ff)
    w.add_head_count(N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(1)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_used)
    if arch != "granitemoe":
        w.add_expert_feed_forward_length(n_ff_exp)
    head_kv = N_HEAD_KV
    if arch == "deepseek2":
        head_kv = 1                                 # MLA as MQA (the converter's)
        w.add_q_lora_rank(0)                        # required unless the layer count is V2-Lite's
        w.add_kv_lora_rank(MLA["kv_lora_rank"])
        w.add_key_length(MLA["kv_lora_rank"] + MLA["rope"])
        w.add_value_length(MLA["kv_lora_rank"])
        w.add_key_length_mla(MLA["nope"] + MLA["rope"])
        w.add_value_length_mla(MLA["v"])
        w.add_rope_dimension_count(MLA["rope"])
        w.add_leading_dense_block_count(lead)
        w.add_expert_shared_count(spec["shexp"])
        w.add_expert_weights_scale(1.0)
        if expert_groups:                           # DeepSeek-V3's routing
            w.add_expert_group_count(expert_groups)
            w.add_expert_group_used_count(expert_groups // 2)
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
            w.add_expert_weights_norm(True)
    elif arch == "dots1":
        head_kv = N_HEAD                            # its loader sizes k / v as n_head heads
        w.add_rope_dimension_count(HEAD_DIM)
    elif arch == "gemma4":
        w.add_key_length(GEMMA4_HEAD_FULL)
        w.add_value_length(GEMMA4_HEAD_FULL)
        w.add_key_length_swa(HEAD_DIM)
        w.add_value_length_swa(HEAD_DIM)
        w.add_rope_dimension_count(GEMMA4_HEAD_FULL)
        w.add_rope_dimension_count_swa(HEAD_DIM)
    else:
        # GLM-4.5: partial rotary factor 0.5
        w.add_rope_dimension_count(HEAD_DIM // 2 if arch == "glm4moe" else HEAD_DIM)
    if arch not in ("deepseek2", "gemma4"):     # (heads of HEAD_DIM whatever n_embd)
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
    w.add_head_count_kv(head_kv)

    if arch in ("glm4moe", "dots1", "ernie4_5-moe"):
        w.add_leading_dense_block_count(lead)
    if arch in ("glm4moe", "dots1"):
        w.add_expert_shared_count(spec["shexp"])
        w.add_expert_weights_scale(1.0)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if arch == "glm4moe":
        w.add_nextn_predict_layers(nextn)
    if arch in ("llama4", "ernie4_5-moe"):
        w.add_interleave_moe_layer_step(step)
    if arch == "ernie4_5-moe":
        w.add_expert_shared_feed_forward_length(n_ff_shexp)
    if arch == "gpt-oss":
        w.add_sliding_window(SLIDING_WINDOW)        # (pattern 2 by default: even layers sliding)
    if arch == "granitemoe":
        w.add_embedding_scale(GRANITE_SCALES["embedding_scale"])
        w.add_residual_scale(GRANITE_SCALES["residual_scale"])
        w.add_attention_scale(1.0 / HEAD_DIM)
        w.add_logit_scale(GRANITE_SCALES["logit_scale"])
    gemma_swa = [il % 2 == 0 for il in range(n_layer)]   # sliding, full, sliding, ...
    if arch == "gemma4":
        w.add_sliding_window(SLIDING_WINDOW)
        w.add_sliding_window_pattern(gemma_swa)
        w.add_embedding_length_per_layer_input(0)   # required (0: no per-layer embeddings)
        w.add_shared_kv_layers(0)
        w.add_final_logit_softcapping(30.0)
    n_vocab = _write_vocab(w)

    # ---- tensors --------------------------------------------------------------------------------
    F16, F32 = T.F16, T.F32

    def add(name: str, qtype, rows: int, cols: int, scale: float, g=None) -> None:
        stored, values = _weights(g or rng, _qtype(qtype), rows, cols, scale)
        w.add_tensor(name, stored, raw_dtype=_qtype(qtype))
        out[name] = values

    def add_vec(name: str, n: int, value: float | None = None, std: float = 0.02, g=None) -> None:
        v = np.full(n, value, np.float32) if value is not None else \
            ((g or rng).standard_normal(n) * std).astype(np.float32)
        w.add_tensor(name, v)
        out[name] = v

    def add_3d(name: str, qtype: T, n: int, rows: int, cols: int, scale: float, g=None) -> None:
        stored, values = _weights(g or rng, qtype, n * rows, cols, scale)
        w.add_tensor(name, stored.reshape(n, rows, -1), raw_dtype=qtype)
        out[name] = values.reshape(n, rows, cols)

    def add_mat(name: str, m: np.ndarray) -> None:     # F32, any shape (numpy order)
        m = np.ascontiguousarray(m, np.float32)
        w.add_tensor(name, m)
        out[name] = m

    def dense_ffn(il: int, n: int) -> None:
        add(_tn(MT.FFN_GATE, il), F16, n, n_embd, sc["ffn"])
        add(_tn(MT.FFN_UP, il), F16, n, n_embd, sc["ffn"])
        add(_tn(MT.FFN_DOWN, il), F16, n_embd, n, sc["ffn"])

    def moe_ffn(il: int) -> None:
        spread = np.linspace(0.5, 1.5, n_expert, dtype=np.float32)[rng.permutation(n_expert)]
        add_mat(_tn(MT.FFN_GATE_INP, il),
                (rng.standard_normal((n_expert, n_embd)) * sc["router"]).astype(np.float32) * spread[:, None])
        if arch == "gpt-oss":
            add_vec(_tn(MT.FFN_GATE_INP, il, "bias"), n_expert, std=0.1)
        if arch == "gemma4":     # the router's input: rms_norm(x) / sqrt(n_embd) * scale
            add_vec(_tn(MT.FFN_GATE_INP, il, "scale"), n_embd, n_embd ** 0.5)
        if arch in ("glm4moe", "dots1", "ernie4_5-moe") or (arch == "deepseek2" and expert_groups):
            # the selection bias (DeepSeek-V3's e_score_correction_bias): small beside sigmoid's spread
            add_vec(_tn(MT.FFN_EXP_PROBS_B, il, "bias"), n_expert, std=0.02)
        names = []
        se = sc["experts"]
        if fused_gate_up:
            # per expert the gate rows [0, n_ff_exp), then the up rows [n_ff_exp, 2 n_ff_exp): the
            # same values as the unfused file's ffn_gate_exps and ffn_up_exps (same seed)
            parts = [_weights(erng, etype, n_expert * n_ff_exp, n_embd, se) for _ in range(2)]
            stored = np.concatenate([p[0].reshape(n_expert, n_ff_exp, -1) for p in parts], axis=1)
            name = _tn(MT.FFN_GATE_UP_EXP, il)
            w.add_tensor(name, stored, raw_dtype=etype)
            out[name] = np.concatenate([p[1].reshape(n_expert, n_ff_exp, n_embd) for p in parts], axis=1)
            names.append(name)
        else:
            for t in (MT.FFN_GATE_EXP, MT.FFN_UP_EXP):
                add_3d(_tn(t, il), etype, n_expert, n_ff_exp, n_embd, se, erng)
                names.append(_tn(t, il))
        add_3d(_tn(MT.FFN_DOWN_EXP, il), etype, n_expert, n_embd, n_ff_exp, se, erng)
        names.append(_tn(MT.FFN_DOWN_EXP, il))
        if arch == "gpt-oss":    # per-expert biases [E, rows], F32
            for t, n in ((MT.FFN_GATE_EXP, n_ff_exp), (MT.FFN_UP_EXP, n_ff_exp), (MT.FFN_DOWN_EXP, n_embd)):
                add_mat(_tn(t, il, "bias"), erng.standard_normal((n_expert, n)) * 0.05)
                names.append(_tn(t, il, "bias"))
        if arch == "gemma4":     # per_expert_scale, applied to each expert's down output
            add_mat(_tn(MT.FFN_DOWN_EXP, il, "scale"), erng.uniform(0.75, 1.25, n_expert))
            names.append(_tn(MT.FFN_DOWN_EXP, il, "scale"))
        info["expert_tensors"][il] = names
        if n_ff_shexp:
            add(_tn(MT.FFN_GATE_SHEXP, il), F16, n_ff_shexp, n_embd, sc["ffn"])
            add(_tn(MT.FFN_UP_SHEXP, il), F16, n_ff_shexp, n_embd, sc["ffn"])
            add(_tn(MT.FFN_DOWN_SHEXP, il), F16, n_embd, n_ff_shexp, sc["ffn"])

    def attention(il: int) -> None:
        sa = sc["attn"]
        if arch == "deepseek2":
            add_vec(_tn(MT.ATTN_KV_A_NORM, il), MLA["kv_lora_rank"], 1.0)
            add(_tn(MT.ATTN_Q, il), F16, N_HEAD * (MLA["nope"] + MLA["rope"]), n_embd, sa)
            add(_tn(MT.ATTN_KV_A_MQA, il), F16, MLA["kv_lora_rank"] + MLA["rope"], n_embd, sa)
            # the converter's split of kv_b: k_b transposed [H, kv_lora, nope], v_b [H, v, kv_lora]
            add_3d(_tn(MT.ATTN_K_B, il), F16, N_HEAD, MLA["kv_lora_rank"], MLA["nope"], 0.2)
            add_3d(_tn(MT.ATTN_V_B, il), F16, N_HEAD, MLA["v"], MLA["kv_lora_rank"], 0.2)
            add(_tn(MT.ATTN_OUT, il), F16, n_embd, N_HEAD * MLA["v"], sa)
            return
        hd = HEAD_DIM
        if arch == "gemma4" and not gemma_swa[il]:
            hd = GEMMA4_HEAD_FULL
        add(_tn(MT.ATTN_Q, il), F16, N_HEAD * hd, n_embd, sa)
        add(_tn(MT.ATTN_K, il), F16, head_kv * hd, n_embd, sa)
        add(_tn(MT.ATTN_V, il), F16, head_kv * hd, n_embd, sa)
        if arch in ("gpt-oss", "glm4moe"):
            add_vec(_tn(MT.ATTN_Q, il, "bias"), N_HEAD * hd)
            add_vec(_tn(MT.ATTN_K, il, "bias"), head_kv * hd)
            add_vec(_tn(MT.ATTN_V, il, "bias"), head_kv * hd)
        add(_tn(MT.ATTN_OUT, il), F16, n_embd, N_HEAD * hd, sa)
        if arch == "gpt-oss":
            add_vec(_tn(MT.ATTN_OUT, il, "bias"), n_embd)
            add_vec(_tn(MT.ATTN_SINKS, il), N_HEAD, std=0.5)
        if arch in ("dots1", "gemma4"):
            add_vec(_tn(MT.ATTN_Q_NORM, il), hd, 1.0)
            add_vec(_tn(MT.ATTN_K_NORM, il), hd, 1.0)

    add("token_embd.weight", F16, n_vocab, n_embd, sc["embd"])
    if arch == "gemma4" and not all(gemma_swa):
        # the full layers' rope factors: every pair rotated (the converter's proportional rope puts 1e30
        # on the pairs it leaves unrotated)
        add_vec(_tn(MT.ROPE_FREQS), GEMMA4_HEAD_FULL // 2, 1.0)
    for il in range(block_count):
        add_vec(_tn(MT.ATTN_NORM, il), n_embd, 1.0)
        attention(il)
        if arch == "gemma4":
            add_vec(_tn(MT.ATTN_POST_NORM, il), n_embd, sc["post_norm"])
            add_vec(_tn(MT.LAYER_OUT_SCALE, il), 1, 1.0)
            add_vec(_tn(MT.FFN_NORM, il), n_embd, 1.0)
            dense_ffn(il, n_ff)                       # the dense MLP, in parallel with the experts
            add_vec(_tn(MT.FFN_POST_NORM, il), n_embd, sc["post_norm"])
            if is_moe(il):
                add_vec(_tn(MT.FFN_POST_NORM_1, il), n_embd, 0.5)
                add_vec(_tn(MT.FFN_PRE_NORM_2, il), n_embd, 1.0)
                add_vec(_tn(MT.FFN_POST_NORM_2, il), n_embd, 1.0)
                moe_ffn(il)
            continue
        if arch in ("gpt-oss", "glm4moe"):            # the FFN's pre-norm, under this name
            add_vec(_tn(MT.ATTN_POST_NORM, il), n_embd, 1.0)
        else:
            add_vec(_tn(MT.FFN_NORM, il), n_embd, 1.0)
        if is_moe(il):
            moe_ffn(il)
        else:
            dense_ffn(il, n_ff)
        if il >= n_layer:                             # glm4moe's MTP block
            add(_tn(MT.NEXTN_EH_PROJ, il), F16, n_embd, 2 * n_embd, sc["attn"])
            add_vec(_tn(MT.NEXTN_ENORM, il), n_embd, 1.0)
            add_vec(_tn(MT.NEXTN_HNORM, il), n_embd, 1.0)
            add_vec(_tn(MT.NEXTN_SHARED_HEAD_NORM, il), n_embd, 1.0)
    add_vec(_tn(MT.OUTPUT_NORM), n_embd, 1.0)
    if arch != "gemma4":                              # gemma's output is token_embd
        add(_tn(MT.OUTPUT), F16, n_vocab, n_embd, sc["output"])

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return info
