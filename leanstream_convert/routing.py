"""The routing pass of a mixture-of-experts conversion: how often each layer's router picks each
expert on the calibration corpus (every domain: prose, code, chat, the user's file), the ranking
the runtime pins its hot set by (backend.Experts: the (layer, expert) pairs routed to most often,
a share of the expert cache).

The pass runs the converted directory itself, through the plugin's MoE op under the conversion's
memory limit (the experts stream from their files as they do at run time; the router is llama.cpp's
own), the first TOKENS tokens of each domain in one batch each (every row's logits kept: llama.cpp's
last layer computes only those rows), and counts the router's choices in the op
(MoEEngine.routing_counts). Writes experts/routing_freq.npy: f32 [n_layer, n_expert], each
layer's routings to each expert per token routed (a row sums to n_expert_used; a layer without
experts: zeros)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from leanstream_ggml.texts import text_tokens

TOKENS = 256    # per domain: one batch (prefill reads each expert at most once per batch)


def domain_tokens(llm, path: Path, n: int = TOKENS) -> list[int]:
    """The first n tokens of a calibration file (chats rendered with the model's template)."""
    tokens, _ = text_tokens(llm, path)
    return tokens[:n]


def run_pass(model_dir: Path, manifest, texts: dict, *, memory_limit: int | None, n_threads: int,
             tokens: int = TOKENS, progress: bool = True) -> np.ndarray:
    """[n_layer, n_expert] f32 routing frequencies (module doc) over ``texts`` ({domain: path})."""
    from tqdm import tqdm

    from leanstream_ggml import Llama

    # logits_all: llama.cpp's last layer computes only the rows whose logits are kept
    llm = Llama.converting(str(model_dir), manifest, n_ctx=tokens, n_batch=tokens, n_ubatch=tokens,
                           n_threads=n_threads, n_threads_batch=n_threads, verbose=False, speculative="off",
                           read_ahead="off", logits_all=True,
                           **({"memory_limit": memory_limit} if memory_limit else {}))
    n_routed = 0
    try:
        for domain, path in tqdm(list(texts.items()), desc="routing", unit="domain", disable=not progress):
            toks = domain_tokens(llm, Path(path), tokens)
            if len(toks) < 2:
                continue
            llm.reset()
            llm.eval(toks)
            n_routed += len(toks)
        moe = manifest.moe
        freq = np.zeros((manifest.n_layer, moe.n_expert), np.float32)
        for il, _ in moe.expert_layers():
            freq[il] = llm.engine.routing_counts(il).astype(np.float64) / max(n_routed, 1)
    finally:
        llm.close()
    return freq
