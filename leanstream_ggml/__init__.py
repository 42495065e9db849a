"""leanstream-ggml: run GGUF models whose FFN streams from disk under a memory budget.

    from leanstream_ggml import Llama          # drop-in for llama_cpp.Llama
    llm = Llama("model.lsm", memory_budget="512MiB")

Importing this package never imports torch or scikit-learn (training is a separate stage).
"""

__version__ = "0.1.0"

__all__ = ["Llama", "__version__"]


def __getattr__(name):
    # lazy: `leanstream convert` and the build script must not load llama.cpp
    if name == "Llama":
        from .llama import Llama

        return Llama
    raise AttributeError(name)
