"""Teacher-forced logits of a llama_cpp.Llama (stock or ours) and their log-probabilities, for the
exactness tests that compare the plugin with stock llama.cpp."""

from __future__ import annotations

import numpy as np


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def teacher_forced(llm, tokens) -> np.ndarray:
    """Logits [len(tokens), n_vocab] f64 of one pass over tokens (logits_all=True)."""
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float64)


def agreement_and_kl(ref: np.ndarray, got: np.ndarray) -> tuple[float, np.ndarray]:
    """Top-1 agreement of two logit arrays [T, n_vocab] and KL(ref || got) per position [T]."""
    pa, pb = log_softmax(ref), log_softmax(got)
    return float((ref.argmax(-1) == got.argmax(-1)).mean()), (np.exp(pa) * (pa - pb)).sum(-1)
