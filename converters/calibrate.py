"""The calibrate stage: how much perplexity leanstream mode's sparse decode costs at each
sparsity, measured on the model's own text, so that ``quality="ppl+5%"`` can choose the sparsity.

The text is the source model's own answers (stock llama-cpp-python on the source GGUF, sampled at
temperature 1 with a fixed seed) to a few of the bundled calibration prompts — never the held-out
evaluation text. Greedy answers would be too easy: every token is the model's own first choice,
and a sparse model that keeps that choice looks free (Qwen2.5-1.5B at s = 0.7: x1.02 on its greedy
answers, x1.13 on held-out prose). The second half of
each window is decoded token by token (sparse decode is sparse only there) with the converted
model in leanstream mode, and compared with stock's logits over the same window.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from leanstream_ggml import manifest as mf

SPARSITIES = (0.3, 0.4, 0.5, 0.6, 0.7)
N_CTX = 256          # one window: 128 tokens of context, 127 scored
N_PROMPTS = 3        # windows: answers long enough to fill one, in the bundled prompts' order
SEED = 1234


def _own_text_windows(src: Path, n_threads: int) -> list[list[int]]:
    import llama_cpp

    from .prompts import PROMPTS

    stock = llama_cpp.Llama(str(src), n_ctx=N_CTX, n_batch=N_CTX, n_threads=n_threads, seed=SEED, verbose=False)
    out = []
    try:
        for prompt in PROMPTS:
            if len(out) == N_PROMPTS:
                break
            toks = stock.tokenize(prompt.encode(), add_bos=True)
            stock.reset()
            for t in stock.generate(toks, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                toks.append(t)
                if len(toks) >= N_CTX or t == stock.token_eos():
                    break
            if len(toks) >= N_CTX:
                out.append(toks[:N_CTX])
    finally:
        stock.close()
    return out


def _logits(llm, w: list[int], decode: bool) -> np.ndarray:
    from leanstream_ggml.harness.perplexity import log_softmax, window_logits

    pos = np.arange(N_CTX // 2, N_CTX - 1)
    return log_softmax(window_logits(llm, w, decode=decode)[pos])


def calibrate(src: Path, out: Path, manifest: mf.Manifest, *, n_threads: int = 2, progress: bool = True,
              log=print) -> list[dict]:
    """[{"sparsity", "ppl_ratio", "agreement"}] of leanstream mode vs stock on the model's own text."""
    import llama_cpp
    from tqdm import tqdm

    from leanstream_ggml import Llama

    ws = _own_text_windows(src, n_threads)
    if not ws:
        log("calibrate: the model's answers were too short to score; no quality table (use sparsity=)")
        return []
    kw = dict(n_ctx=N_CTX, n_batch=N_CTX, n_threads=n_threads, logits_all=True, verbose=False)
    stock = llama_cpp.Llama(str(src), **kw)
    try:
        refs = [_logits(stock, w, decode=False) for w in ws]
    finally:
        stock.close()
    table = []
    for s in tqdm(SPARSITIES, desc="calibrating sparse decode", unit="sparsity", disable=not progress):
        llm = Llama(str(out), mode="leanstream", sparsity=s, _manifest=manifest, **kw)
        try:
            nll_t, nll_r, agree = [], [], []
            for w, lr in zip(ws, refs):
                lt = _logits(llm, w, decode=True)
                nxt = np.asarray(w)[N_CTX // 2 + 1:N_CTX]
                idx = np.arange(len(nxt))
                nll_t.append(-lt[idx, nxt])
                nll_r.append(-lr[idx, nxt])
                agree.append(lt.argmax(-1) == lr.argmax(-1))
        finally:
            llm.close()
        ratio = math.exp(float(np.concatenate(nll_t).mean() - np.concatenate(nll_r).mean()))
        table.append({"sparsity": s, "ppl_ratio": round(ratio, 4),
                      "agreement": round(float(np.concatenate(agree).mean()), 4)})
    return table
