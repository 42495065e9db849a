"""How a text is scored, as llama.cpp's tools/perplexity does it (perplexity() with the default
settings): the text's tokens (texts.py) are cut into ``len(tokens) // n_ctx`` windows of ``n_ctx``
tokens; in each window the first token is replaced by BOS (when the model adds one), the window
is evaluated from an empty context with logits for every position, and the tokens of its second
half are scored: position j in ``[n_ctx/2, n_ctx-1)`` predicts token j+1,
NLL = -log softmax(logits[j])[token j+1]. The first half only gives context.

    for w in windows(tokens, n_ctx, add_bos, llm.token_bos()):
        nll = window_nll(window_logits(llm, w, decode=True), w)

The converter's calibration and the tools (`leanstream perplexity`, tune, bench/) score with these,
so a perplexity means the same wherever it is measured.
"""

from __future__ import annotations

import numpy as np


def windows(tokens: list[int], n_ctx: int, add_bos: bool, bos: int, max_chunks: int | None = None) -> list[list[int]]:
    """The evaluation windows: consecutive n_ctx slices, first token replaced by BOS if add_bos."""
    if n_ctx < 4:
        raise ValueError("n_ctx must be at least 4")
    n = len(tokens) // n_ctx
    if max_chunks is not None:
        n = min(n, max_chunks)
    if n == 0:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one window of n_ctx={n_ctx}; "
                         f"use a longer text or a smaller --ctx-size")
    out = []
    for i in range(n):
        w = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if add_bos:
            w[0] = bos
        out.append(w)
    return out


def scored_range(n_ctx: int) -> range:
    """Positions whose logits are scored (each predicts the next token)."""
    return range(n_ctx // 2, n_ctx - 1)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def window_logits(llm, window: list[int], decode: bool = False) -> np.ndarray:
    """Logits [n_ctx, n_vocab] (float32 copy) of one window evaluated from an empty context.
    Needs a Llama opened with logits_all=True and n_batch >= n_ctx.

    decode: the unscored first half goes in as one batch (a prompt: prefill), every later token
    on its own (generation). The sparse modes are sparse only for one-token batches, so this is
    how their quality must be measured; for stock and dense it changes nothing but the speed."""
    llm.reset()
    if not decode:
        llm.eval(window)
    else:
        split = scored_range(len(window)).start
        llm.eval(window[:split])
        for t in window[split:]:
            llm.eval([t])
    return np.array(llm.scores[:len(window)], dtype=np.float32, copy=True)


def window_nll(logits: np.ndarray, window: list[int]) -> np.ndarray:
    """NLL of each scored position of one window (nats), float64."""
    pos = np.array(scored_range(len(window)))
    lp = log_softmax(logits[pos])
    return -lp[np.arange(len(pos)), np.asarray(window)[pos + 1]]
