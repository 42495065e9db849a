"""What the tools read of any ``llama_cpp.Llama``, stock or leanstream's, that llama-cpp-python's
public API does not give: the last decode's logits without logits_all, llama.cpp's counters of
the context, a token's text, and whether libllama is the patched build. (The implementations
are in _llama_cpp.py, the one module that uses llama-cpp-python's internals; a
``leanstream_ggml.Llama`` has the first two as methods too.)

    from leanstream_ggml import context
    llm.eval(tokens); tok = int(context.logits(llm).argmax())
    context.reset_perf(llm); ...; p = context.perf_context(llm); p.n_eval, p.t_eval_ms
"""

from ._llama_cpp import has_ffn_builder as libllama_patched  # noqa: F401
from ._llama_cpp import logits, perf_context, reset_perf, token_text  # noqa: F401

__all__ = ["libllama_patched", "logits", "perf_context", "reset_perf", "token_text"]
