"""Why a model with a recurrent state decodes without speculation (docs/design.md §21).

A verify pass decodes a draft tree into the model's memory, then drops what the walk rejected
with llama_memory_seq_rm (``_llama_cpp.tree_keep``: sequence 0 from the first rejected position,
the tree's other sequences whole; ``kv_cache_trim`` after the self draft's steps: every sequence
from n_past). A recurrent layer (Mamba, RWKV, Gated DeltaNet, a short convolution) keeps one state
per sequence, every token seen folded in, not a row per position, and llama.cpp
(src/llama-memory-recurrent.cpp, ``llama_memory_recurrent::seq_rm``) removes a whole sequence only:
a suffix of one is refused (false, nothing changed; undone only from the experimental n_rs_seq
snapshots, on a few architectures, one pending rollback per sequence), a suffix of every sequence
(seq_id -1) too. A hybrid's memory (llama-memory-hybrid.cpp) asks its recurrent part first, so its
attention cache keeps the rejected rows as well. The rejected tokens stay in the state, and the
next decode fails (its positions do not follow the memory's). So there ``speculative="auto"``
drafts nothing and says why; "self" and "ngram" are refused.
"""

from __future__ import annotations

import ctypes
import os

# llama.cpp's llm_arch_is_recurrent and llm_arch_is_hybrid (src/llama-arch.cpp), by the GGUF's
# general.architecture: what llama_model_is_recurrent / llama_model_is_hybrid answer, known before
# the model loads (the context's n_seq_max and the memory plan's logit rows depend on it; Llama
# asks those functions of the loaded model as well). Checked against the llama.cpp this project
# pins: a new pin reads that file again
RECURRENT = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
HYBRID = frozenset({"jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
                    "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next",
                    "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01"})
# the hybrids whose recurrent layers are all but every full_attention_interval-th (the loader's
# default interval here), unless <arch>.attention.recurrent_layers lists them (src/models/<arch>.cpp)
_INTERVAL = {"qwen3next": 4, "qwen35": 4, "qwen35moe": 4, "qwen4exp": 4, "minimax-01": 8}

# gguf.h's enum gguf_type: the integer and bool element types of an array, as ctypes
_GGUF_INTS = {0: ctypes.c_uint8, 1: ctypes.c_int8, 2: ctypes.c_uint16, 3: ctypes.c_int16, 4: ctypes.c_uint32,
              5: ctypes.c_int32, 7: ctypes.c_uint8, 10: ctypes.c_uint64, 11: ctypes.c_int64}


def phrase(arch: str, layers: list[int] | None, n_layer: int, hybrid: bool) -> str:
    """The reason, as stats()["speculative_reason"] and `leanstream info` say it."""
    if not hybrid:
        kind = "recurrent: every layer"
    elif layers is None:
        kind = "hybrid: recurrent and attention layers"
    elif len(layers) <= 8:
        kind = f"hybrid: layer{'s' * (len(layers) != 1)} {', '.join(map(str, layers))} of {n_layer} recurrent"
    else:
        kind = f"hybrid: {len(layers)} of {n_layer} layers recurrent"
    return f"off: {arch} keeps a recurrent state ({kind}) that a rejected draft cannot be dropped from"


def reason(gguf_path: str | os.PathLike, arch: str | None = None) -> str | None:
    """Why speculation is off for the model of this GGUF (a model directory's base.gguf: its
    header alone is read, by ggml's reader), or None where its memory drops a rejected draft (or
    the file is not a readable GGUF: what loads it says so). ``arch``: the architecture the
    manifest names, where known (one in neither table needs no header: a large vocabulary makes
    reading one cost tens of milliseconds)."""
    from leanstream_ggml.llamacpp import ggml_ctypes

    if arch is not None and arch not in RECURRENT and arch not in HYBRID:
        return None
    g = ggml_ctypes.base()
    ctx = g.gguf_init_from_file(os.fspath(gguf_path).encode(), ggml_ctypes.GGUFInitParams(True, None))
    if not ctx:
        return None
    try:
        k = g.gguf_find_key(ctx, b"general.architecture")
        arch = g.gguf_get_val_str(ctx, k).decode() if k >= 0 else "llama"
        if arch not in RECURRENT and arch not in HYBRID:
            return None
        n_layer = (_ints(g, ctx, f"{arch}.block_count") or [0])[0]
        n_layer -= (_ints(g, ctx, f"{arch}.nextn_predict_layers") or [0])[0]   # (MTP blocks: attention)
        # (no layer found recurrent: a rule this reader has wrong, not a model without one)
        return phrase(arch, _recurrent_layers(g, ctx, arch, n_layer) or None, n_layer, arch in HYBRID)
    finally:
        g.gguf_free(ctx)


def loaded(model, arch: str) -> str | None:
    """``reason`` as llama.cpp itself answers it for a loaded llama_model (llama_model_is_recurrent,
    llama_model_is_hybrid), its layers unnamed."""
    from llama_cpp import llama_cpp as lib

    if lib.llama_model_is_recurrent(model):
        return phrase(arch, None, 0, False)
    return phrase(arch, None, 0, True) if lib.llama_model_is_hybrid(model) else None


def _ints(g, ctx, name: str) -> list[int] | None:
    """An integer key's value(s) (an array's elements), or None where absent or not integers."""
    from leanstream_ggml.llamacpp import ggml_ctypes

    k = g.gguf_find_key(ctx, name.encode())
    if k < 0:
        return None
    t = g.gguf_get_kv_type(ctx, k)
    if t == ggml_ctypes.GGUF_TYPE_UINT32:
        return [int(g.gguf_get_val_u32(ctx, k))]
    if t != ggml_ctypes.GGUF_TYPE_ARRAY or g.gguf_get_arr_type(ctx, k) not in _GGUF_INTS:
        return None
    n = g.gguf_get_arr_n(ctx, k)
    return list((_GGUF_INTS[g.gguf_get_arr_type(ctx, k)] * n).from_address(g.gguf_get_arr_data(ctx, k))) if n else []


def _recurrent_layers(g, ctx, arch: str, n_layer: int) -> list[int] | None:
    """The recurrent layers as llama.cpp's loader of ``arch`` marks them (hparams.is_recr_impl in
    src/models/<arch>.cpp), or None where this reader does not know its rule."""
    def per_layer(name: str) -> list[int] | None:
        v = _ints(g, ctx, f"{arch}.{name}")
        return None if v is None else (v * n_layer if len(v) == 1 else v)[:n_layer]

    if arch in RECURRENT or arch == "falcon-h1":      # (falcon-h1: a Mamba-2 mixer beside each attention)
        return list(range(n_layer))
    if arch in _INTERVAL:
        marked = per_layer("attention.recurrent_layers")
        if marked is not None:
            return [i for i, r in enumerate(marked) if r]
        every = (_ints(g, ctx, f"{arch}.full_attention_interval") or [_INTERVAL[arch]])[0] or 1
        return [i for i in range(n_layer) if (i + 1) % every]
    kv = per_layer("attention.head_count_kv")
    if kv is None or len(kv) < n_layer or arch == "deepseek4":
        return None
    if arch in ("nemotron_h", "nemotron_h_moe"):        # Mamba-2: no attention heads and no FFN
        ff = per_layer("feed_forward_length")
        return None if ff is None or len(ff) < n_layer else [i for i in range(n_layer) if kv[i] == 0 and ff[i] == 0]
    return [i for i in range(n_layer) if kv[i] == 0]
