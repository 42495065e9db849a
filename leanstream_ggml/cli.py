"""The `leanstream` command. Each subcommand lives in its own module, which exposes
``register(subparsers)`` adding an argparse parser whose ``func(args) -> int`` runs it."""

from __future__ import annotations

import argparse
import importlib
import sys

# modules providing subcommands, in the order `leanstream --help` lists them
COMMAND_MODULES = [
    "converters.cli",            # convert, info
    "leanstream_ggml.verify",    # verify
    "leanstream_ggml.chat",      # chat
    "leanstream_ggml.harness.cli",  # bench, perplexity
    "leanstream_ggml.predictor.cli",  # profile, train-predictor
]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="leanstream",
                                 description="Run GGUF models with a streamed sparse FFN under a memory budget.")
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
    except Exception as e:
        from .errors import describe

        line = describe(e)      # OS errors, bad model directories, parameters, corrupt files
        if line is None:
            raise               # a bug: keep the traceback
        print(f"leanstream {args.command}: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
