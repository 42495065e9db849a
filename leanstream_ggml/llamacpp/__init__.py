"""llama.cpp through llama-cpp-python: its internals this project relies on (``_llama_cpp``), ggml's
C API by ctypes, the source GGUF on llama.cpp's own kernels (``stock``), and what the tools read of
any ``llama_cpp.Llama`` (``context``)."""
