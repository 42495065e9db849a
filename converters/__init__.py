"""GGUF -> LeanStream model directory (``leanstream convert``).

    from converters import convert
    manifest = convert("model.gguf", "model.lsm")    # returns leanstream_ggml.manifest.Manifest

Importing this package is cheap (the CLI registry imports it for every command): gguf-py and
numpy load on first use of ``convert``. The implementation is in ``convert_gguf.py`` (a module
named ``convert`` would shadow the function); the block file layout in ``blockfile.py``.
"""

__all__ = ["convert", "ConvertError", "device_align"]


def __getattr__(name):
    if name in __all__:
        import importlib

        return getattr(importlib.import_module(".convert_gguf", __name__), name)
    raise AttributeError(name)
