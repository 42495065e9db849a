"""`leanstream perplexity`: llama-perplexity's scoring, and agreement / KL against a reference.

Scoring, as llama.cpp's tools/perplexity does it: the library's windows and scored positions
(leanstream_ggml/scoring.py; the converter's calibration scores with the same), the text tokenized
once (BOS first where the vocabulary asks for it; a .jsonl file's chats in the model's template,
leanstream_ggml/texts.py). Perplexity = exp(mean NLL over all scored positions).

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
from pathlib import Path

import numpy as np

from leanstream_ggml.scoring import log_softmax, scored_range, window_logits, window_nll, windows
from leanstream_ggml.texts import text_tokens, tokenize_for_perplexity


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


def _tokens(llm, text: str | Path) -> tuple[list[int], bool]:
    """(tokens, add_bos) of a text, or of a text or chat file (a Path: texts.text_tokens)."""
    return text_tokens(llm, text) if isinstance(text, Path) else tokenize_for_perplexity(llm, text)


def perplexity(llm, text: str | Path, n_ctx: int, max_chunks: int | None = None,
               decode: bool = False) -> PerplexityResult:
    """Perplexity of ``llm`` on a text (str) or a text or chat file (Path)."""
    tokens, add_bos = _tokens(llm, text)
    nlls = []
    for w in windows(tokens, n_ctx, add_bos, llm.token_bos(), max_chunks):
        nlls.append(window_nll(window_logits(llm, w, decode), w))
    return _result(nlls, n_ctx, len(tokens))


def compare(llm, ref, text: str | Path, n_ctx: int, max_chunks: int | None = None, decode: bool = False) -> dict:
    """Perplexity of ``llm`` and of ``ref`` over identical windows, plus top-1 agreement and mean
    KL(ref || llm) over the scored positions. Tokenization must agree (same vocabulary).
    decode: ``llm`` scores the second half token by token (see window_logits); ``ref`` in one batch."""
    tokens, add_bos = _tokens(llm, text)
    ref_tokens, _ = _tokens(ref, text)
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
