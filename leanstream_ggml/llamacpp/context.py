"""What the tools read of any ``llama_cpp.Llama``, stock or leanstream's, through
llama-cpp-python's public API only (its ``ctx`` / ``model`` properties and the C bindings of
``llama_cpp``): the last decode's logits without logits_all, llama.cpp's counters of the
context, a token's text, and whether libllama is the patched build. A ``leanstream_ggml.Llama``
has the first two as methods too.

    from leanstream_ggml.llamacpp import context
    llm.eval(tokens); tok = int(context.logits(llm).argmax())
    context.reset_perf(llm); ...; p = context.perf_context(llm); p.n_eval, p.t_eval_ms
"""

from __future__ import annotations

import llama_cpp
import numpy as np

from leanstream_ggml.llamacpp._llama_cpp import has_ffn_builder as libllama_patched  # noqa: F401

__all__ = ["libllama_patched", "logits", "perf_context", "reset_perf", "token_text"]


def logits(llm: llama_cpp.Llama, i: int = -1) -> np.ndarray:
    """f32 [n_vocab]: the logits of row i of the last decode (-1: its last row; without
    logits_all only the rows a batch asked for have them), a view of llama.cpp's buffer, valid
    until the next decode (copy to keep)."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, i), shape=(llm.n_vocab(),))


def perf_context(llm: llama_cpp.Llama):
    """llama.cpp's counters of llm's context since it was created or ``reset_perf``
    (``llama_perf_context_data``: n_p_eval / t_p_eval_ms the prompt's tokens and milliseconds,
    n_eval / t_eval_ms the decoded ones')."""
    return llama_cpp.llama_perf_context(llm.ctx)


def reset_perf(llm: llama_cpp.Llama) -> None:
    llama_cpp.llama_perf_context_reset(llm.ctx)


def token_text(llm: llama_cpp.Llama, token: int) -> str:
    """A token's text as the vocabulary spells it (special tokens too: "<|im_end|>")."""
    return llama_cpp.llama_vocab_get_text(llama_cpp.llama_model_get_vocab(llm.model), token).decode("utf-8")
