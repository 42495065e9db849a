"""The native engine's binding: the cffi binding of native/include/leanstream.h (``_native``, and
``capi`` for the packages built on the library), the Python owners of its objects (``engine``:
neuron blocks of dense layers; ``moe``: experts), its mode table, parameters and controller policy."""
