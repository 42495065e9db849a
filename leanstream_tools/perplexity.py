"""`leanstream perplexity`: llama-perplexity's scoring, and agreement / KL against a reference.

Scoring, as llama.cpp's tools/perplexity does it (perplexity() with the default settings):
the text is tokenized once (BOS first where the vocabulary asks for it) and cut into
``n_chunks = n_tokens // n_ctx`` windows of ``n_ctx`` tokens; in each window the first token is
replaced by BOS (when the model adds one), the window is evaluated from an empty context in one
batch with logits for every position, and the tokens of its second half are scored: position j
in ``[n_ctx/2, n_ctx-1)`` predicts token j+1, NLL = -log softmax(logits[j])[token j+1].
Perplexity = exp(mean NLL over all scored positions). The first half only gives context.

Against a reference (stock llama-cpp-python on the source GGUF), over the same windows and the
same scored positions, with full logit rows in float64:
- top-1 agreement = fraction of positions where argmax(test) == argmax(reference)
  (llama-perplexity's "Same top p"), and
- mean KL = mean over positions of KL(P_ref || P_test) (llama-perplexity --kl-divergence).
Scored positions start at n_ctx/2, so position 0 (Qwen's outlier activation, docs/design.md §9) is never
scored. Both models are open at once and evaluated window by window, so no logits are stored.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np


def tokenize_for_perplexity(llm, text: str) -> tuple[list[int], bool]:
    """(tokens, add_bos): the text's tokens with BOS first iff the vocabulary adds one."""
    with_special = llm.tokenize(text.encode("utf-8"), add_bos=True)
    plain = llm.tokenize(text.encode("utf-8"), add_bos=False)
    return with_special, len(with_special) > len(plain)


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


@dataclass
class PerplexityResult:
    ppl: float
    nll_mean: float
    n_scored: int
    n_chunks: int
    n_ctx: int
    n_text_tokens: int
    chunk_ppl: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _result(nlls: list[np.ndarray], n_ctx: int, n_tokens: int) -> PerplexityResult:
    allv = np.concatenate(nlls)
    return PerplexityResult(ppl=float(math.exp(allv.mean())), nll_mean=float(allv.mean()), n_scored=int(allv.size),
                            n_chunks=len(nlls), n_ctx=n_ctx, n_text_tokens=n_tokens,
                            chunk_ppl=[float(math.exp(v.mean())) for v in nlls])


def perplexity(llm, text: str, n_ctx: int, max_chunks: int | None = None, decode: bool = False) -> PerplexityResult:
    tokens, add_bos = tokenize_for_perplexity(llm, text)
    nlls = []
    for w in windows(tokens, n_ctx, add_bos, llm.token_bos(), max_chunks):
        nlls.append(window_nll(window_logits(llm, w, decode), w))
    return _result(nlls, n_ctx, len(tokens))


def compare(llm, ref, text: str, n_ctx: int, max_chunks: int | None = None, decode: bool = False) -> dict:
    """Perplexity of ``llm`` and of ``ref`` over identical windows, plus top-1 agreement and mean
    KL(ref || llm) over the scored positions. Tokenization must agree (same vocabulary).
    decode: ``llm`` scores the second half token by token (see window_logits); ``ref`` in one batch."""
    tokens, add_bos = tokenize_for_perplexity(llm, text)
    ref_tokens, _ = tokenize_for_perplexity(ref, text)
    if tokens != ref_tokens:
        raise ValueError("the model and the reference tokenize the text differently; not the same vocabulary")
    nll_t, nll_r, agree, kl = [], [], [], []
    for w in windows(tokens, n_ctx, add_bos, llm.token_bos(), max_chunks):
        pos = np.array(scored_range(n_ctx))
        lt = window_logits(llm, w, decode)[pos]
        lr = window_logits(ref, w)[pos]
        lpt, lpr = log_softmax(lt), log_softmax(lr)
        nxt = np.asarray(w)[pos + 1]
        nll_t.append(-lpt[np.arange(len(pos)), nxt])
        nll_r.append(-lpr[np.arange(len(pos)), nxt])
        agree.append(lt.argmax(axis=-1) == lr.argmax(axis=-1))
        kl.append((np.exp(lpr) * (lpr - lpt)).sum(axis=-1))
    test, refr = _result(nll_t, n_ctx, len(tokens)), _result(nll_r, n_ctx, len(tokens))
    kl_all = np.concatenate(kl)
    return {
        "ppl": test.ppl,
        "ppl_reference": refr.ppl,
        "ppl_ratio": test.ppl / refr.ppl,
        "top1_agreement": float(np.concatenate(agree).mean()),
        "kl_mean": float(kl_all.mean()),
        "kl_max": float(kl_all.max()),
        "n_scored": test.n_scored, "n_chunks": test.n_chunks, "n_ctx": n_ctx, "n_text_tokens": len(tokens),
        "test_result": test.to_dict(), "reference_result": refr.to_dict(),
    }
