"""leanstream-ggml: run GGUF models whose FFN streams from disk under a memory budget.

    from leanstream_ggml import Llama          # drop-in for llama_cpp.Llama
    llm = Llama("model.lsm", memory_budget="512MiB")

Importing this package never imports torch or scikit-learn (training is a separate stage).
"""

import os as _os

__version__ = "0.1.0"

# ggml's CPU threads meet at an OpenMP barrier after every graph node; libgomp spins 300 000 rounds
# there before it sleeps. With another process busy on every core, the spinning thread holds the
# core the thread it waits for needs (measured on SmolLM2, 2 cores, one busy process per core:
# decode 0.35x its quiet speed with libgomp's default, 0.44x with 30 000; quiet speed unchanged).
# libgomp reads this once, when llama.cpp's libraries load: importing llama_cpp before this package
# keeps the user's (or libgomp's) setting. A value the user set is never overridden.
_os.environ.setdefault("GOMP_SPINCOUNT", "30000")

__all__ = ["Llama", "__version__"]


def __getattr__(name):
    # lazy: `leanstream convert` and the build script must not load llama.cpp
    if name == "Llama":
        from leanstream_ggml.llama import Llama

        return Llama
    raise AttributeError(name)
