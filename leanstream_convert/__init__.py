"""GGUF -> LeanStream model directory (``leanstream convert``).

    from leanstream_convert import convert
    manifest = convert("model.gguf", "model.lsm")    # returns leanstream_ggml.model.manifest.Manifest

``convert`` is the pipeline `leanstream convert` runs, with its defaults (``stages.convert_model``:
block files, the ls2 sketch, the neuron order and the quality calibration; ``sketch="none"``
writes the block files alone, for dense mode, in seconds).

Importing this package is cheap (the CLI registry imports it for every command): gguf-py and
numpy load on first use of ``convert``. The stages are in ``stages.py``; the read and write
stages in ``convert_gguf.py``, the block file writer in ``blockfile.py``.
"""

__all__ = ["convert", "ConvertError", "device_align"]

_WHERE = {"convert": (".stages", "convert_model"), "ConvertError": (".convert_gguf", "ConvertError"),
          "device_align": (".convert_gguf", "device_align")}


def __getattr__(name):
    if name in _WHERE:
        import importlib

        module, attr = _WHERE[name]
        return getattr(importlib.import_module(module, __name__), attr)
    raise AttributeError(name)
