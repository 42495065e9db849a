"""The runtime's own commands (``leanstream info``, ``verify``, ``chat``, ``serve``): each module
exposes ``register(subparsers)`` for leanstream_ggml/cli.py."""
