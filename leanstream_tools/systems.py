"""Open a model as one of the systems the harness compares, with identical llama.cpp settings.

- "stock":      llama_cpp.Llama on a plain GGUF (mmap, as llama-cpp-python users run it).
- "stock+lookup": the same with llama-cpp-python's own speculative decoding, prompt lookup
                (draft_model=LlamaPromptLookupDecoding, its default 10 tokens a proposal).
- "leanstream": leanstream_ggml.Llama on a converted model directory, in one of the engine's
                modes (docs/design.md §4: dense, oneshot, dejavu+, powerinfer2, leanstream).

A GGUF file means stock, a directory means leanstream, unless the caller says otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

# the systems by their names on the command line (--system) and in every report: the plugin's is
# "leanstream", the project's name, which is also one of the engine's modes: compare a system
# with these, a mode through leanstream_ggml.native.modes
STOCK = "stock"
LOOKUP = "lookup"                  # stock+lookup's speculative kind (a Llama's .speculative)
STOCK_LOOKUP = f"{STOCK}+{LOOKUP}"
PLUGIN = "leanstream"
SYSTEMS = (STOCK, STOCK_LOOKUP, PLUGIN)
LOOKUP_TOKENS = 10                 # llama-cpp-python's default proposal (LlamaPromptLookupDecoding's num_pred_tokens)


def detect_system(model_path: str | os.PathLike) -> str:
    return PLUGIN if Path(model_path).is_dir() else STOCK


def stock_description() -> str:
    """Which llama-cpp-python "stock" is: the patched build behaves exactly like the upstream one
    while its FFN hook is unset, which it is for every plain GGUF."""
    import llama_cpp

    from leanstream_ggml.llamacpp import context

    patched = context.libllama_patched()
    return (f"llama-cpp-python {llama_cpp.__version__}, "
            + ("patched build, hook unset" if patched else "upstream build"))


def open_model(model_path: str | os.PathLike, system: str | None = None, *, n_ctx: int = 512,
               n_threads: int | None = None, n_batch: int = 512, logits_all: bool = False,
               mode: str = "dense", memory_budget=None, seed: int = 0, extra: dict | None = None):
    """A Llama for ``system`` ("stock" | "stock+lookup" | "leanstream"; None: detect from the
    path). All get the same context parameters; only the leanstream one takes mode and
    memory_budget. ``.speculative`` says how generate decodes ("lookup" for stock+lookup, the
    plugin's kind; bench decodes through generate where it is not "off")."""
    system = system or detect_system(model_path)
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r} (known: {', '.join(SYSTEMS)})")
    n_threads = n_threads or len(os.sched_getaffinity(0))
    kw = dict(model_path=str(model_path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
              n_batch=n_batch, n_ubatch=n_batch, logits_all=logits_all, seed=seed, verbose=False)
    kw.update(extra or {})
    if system != PLUGIN:
        if Path(model_path).is_dir():
            raise ValueError(f"{model_path} is a model directory; stock llama-cpp-python needs a GGUF file")
        from llama_cpp import Llama
        if system == STOCK:
            return Llama(**kw)
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        # with a draft model llama-cpp-python decodes with every row's logits (a verify pass
        # samples each row) and copies them into its scores array at their positions, which
        # has n_ctx rows only with logits_all=True (else n_batch: past n_batch tokens the copy
        # fails): its users pass it too
        llm = Llama(**kw | {"logits_all": True,
                            "draft_model": LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)})
        llm.speculative = LOOKUP
        return llm
    from leanstream_ggml import Llama  # the plugin (leanstream_ggml/llama.py)
    return Llama(memory_budget=memory_budget, mode=mode, **kw)


def engine_stats(llm) -> dict:
    """The engine's counters (miss ratio, bytes read, I/O stalls, ...) or {} for stock."""
    fn = getattr(llm, "stats", None)
    if fn is None:
        return {}
    try:
        return dict(fn())
    except Exception as e:  # a counter read must not lose a benchmark
        return {"error": f"{type(e).__name__}: {e}"}


def reset_engine_stats(llm) -> None:
    fn = getattr(llm, "reset_stats", None)
    if fn is not None:
        fn()
