"""The vocab stage: which tokens the speculative draft's output projection computes.

A draft step decodes one token with the resident part of the model; with a vocabulary of 152k
tokens (Qwen2.5) the output matrix alone is ~190 MB, more than the rest of the step reads. The
draft only has to guess what the model will say, so, as FR-Spec (2025) does with a frequency
ranking, its output projection computes a few tens of thousands of rows (the full one still
verifies every token, so no answer changes). The ranking: the model's own mean predicted
probability over every position of the calibration corpus (prose, code, chat, the user's file),
a smooth estimate of what it says in those domains even for tokens the corpus never contains.
The runtime adds the tokens of its context (names a prompt brings), see speculative.Drafter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

N_CTX = 512    # tokens per chunk of the corpus
SKIP = 16      # the first positions of a chunk (little context) are not counted


class _Tokens:
    """profile.text_sequences' tokenizer interface over a llama_cpp.Llama."""

    def __init__(self, llm):
        self.llm = llm

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=True, special=False)


def vocab_ranking(src: str | Path, texts: list[Path], *, n_threads: int = 2, progress: bool = True) -> np.ndarray:
    """int32 [n_vocab]: every token id, by decreasing mean predicted probability of the model
    ``src`` (a GGUF) over the positions of ``texts`` (ties: lower id first)."""
    import llama_cpp
    from tqdm import tqdm

    from .profile import text_sequences

    llm = llama_cpp.Llama(str(src), n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=n_threads,
                          n_threads_batch=n_threads, logits_all=True, verbose=False)
    try:
        seqs = [q for p in texts for q in text_sequences(_Tokens(llm), p, n_ctx=N_CTX, skip=SKIP)]
        acc = np.zeros(llm.n_vocab(), dtype=np.float64)
        for seq in tqdm(seqs, desc="ranking the draft's vocabulary", unit="chunk", disable=not progress):
            toks = seq["tokens"]
            llm.reset()
            llm.eval(toks)
            z = np.asarray(llm.scores[seq["start"]:len(toks)], dtype=np.float64)
            z -= z.max(axis=1, keepdims=True)
            p = np.exp(z)
            acc += (p / p.sum(axis=1, keepdims=True)).sum(axis=0)
    finally:
        llm.close()
    return np.argsort(-acc, kind="stable").astype(np.int32)
