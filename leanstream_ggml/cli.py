"""The `leanstream` command. Each subcommand lives in its own module, which exposes
``register(subparsers)`` adding an argparse parser whose ``func(args) -> int`` runs it."""

from __future__ import annotations

import argparse
import importlib
import sys

# modules providing subcommands, in the order `leanstream --help` lists them
COMMAND_MODULES = [
    "converters.cli",            # convert, info
    "leanstream_ggml.chat",      # chat
    "leanstream_ggml.server",    # serve
    "leanstream_ggml.harness.cli",  # bench, perplexity
    "leanstream_ggml.predictor.cli",  # profile, train-predictor
]


def version_string() -> str:
    """This package's version and the llama-cpp-python it runs on (read from the installed
    metadata: printing it must not load llama.cpp)."""
    from importlib import metadata

    from . import __version__

    try:
        llama = metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        llama = "not installed"
    return f"leanstream-ggml {__version__} (llama-cpp-python {llama})"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="leanstream",
                                 description="Run GGUF models with a streamed sparse FFN under a memory budget.")
    ap.add_argument("--version", action="version", version=version_string())
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
