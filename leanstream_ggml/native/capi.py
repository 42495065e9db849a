"""The native library's C API as cffi objects, for the packages built on the library: the
converter runs the library's own sketch quantizer and predictor evaluator through it, so that what
it writes is what the runtime reads. ``check(status, what)`` turns a status into LeanstreamError
with the library's message (the library's own modules use ``_native`` directly)."""

from leanstream_ggml.native._native import LeanstreamError, check, ffi, lib

__all__ = ["LeanstreamError", "check", "ffi", "lib"]
