"""The `leanstream` command. Each subcommand lives in a module that exposes
``register(subparsers)`` adding argparse parsers whose ``func(args) -> int`` runs them.

The runtime's own commands (info, verify, chat, serve) are listed in COMMANDS. Everything else
sits on top of the library, which never names it: the converter (convert, profile,
train-predictor: the package leanstream_convert) and the tools (bench, perplexity, compare, eval,
tune: leanstream_tools) each declare their commands as entry points of the group
``leanstream.commands`` (pyproject.toml), objects with ``register(subparsers)`` and a one-line
``help`` (``Command`` below), loaded only when `leanstream --help` lists them or one runs. So
running `chat`, `bench` or `perplexity` never imports the converter (or torch, scikit-learn, gguf).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


def version_string() -> str:
    """This package's version and the llama-cpp-python it runs on (read from the installed
    metadata: printing it must not load llama.cpp)."""
    from importlib import metadata

    from leanstream_ggml import __version__

    try:
        llama = metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        llama = "not installed"
    return f"leanstream-ggml {__version__} (llama-cpp-python {llama})"

# the runtime's commands: name -> (its module here, one-line help), in the order `leanstream --help`
# lists them (the entry points' commands follow)
COMMANDS = {
    "info": ("leanstream_ggml.commands.info", "describe a converted model directory"),
    "verify": ("leanstream_ggml.commands.verify", "check every checksum of a model directory"),
    "chat": ("leanstream_ggml.commands.chat", "chat with a converted model (streams tokens, keeps history)"),
    "serve": ("leanstream_ggml.commands.server", "llama-cpp-python's OpenAI-compatible server on a converted model"),
}


@dataclass(frozen=True)
class Command:
    """A command a package on top of the library adds: its entry point names one of these."""

    module: str      # the module (of the package that declares it) whose register(subparsers) adds its parser
    help: str        # the line `leanstream --help` lists it with

    def register(self, subparsers) -> None:
        importlib.import_module(self.module).register(subparsers)


def command_line() -> list[str]:
    """The argv that runs `leanstream` in a child process with this interpreter (what a tool runs
    another command with, e.g. a conversion, whose imports must stay out of its own process)."""
    return [sys.executable, "-m", __name__]


PLUGIN_GROUP = "leanstream.commands"   # the entry points of the commands installed packages add


def plugins() -> dict:
    """name -> entry point of every command an installed package adds (in its metadata's order)."""
    from importlib import metadata

    return {ep.name: ep for ep in metadata.entry_points(group=PLUGIN_GROUP) if ep.name not in COMMANDS}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser for one command (its module imported and registered), or for the listing."""
    ap = argparse.ArgumentParser(prog="leanstream",
                                 description="Run GGUF models with a streamed sparse FFN under a memory budget.")
    ap.add_argument("--version", action="version", version=version_string())
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    if command in COMMANDS:
        importlib.import_module(COMMANDS[command][0]).register(sub)
        return ap
    extra = plugins()
    if command in extra:
        extra[command].load().register(sub)
        return ap
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text)
    for name, ep in extra.items():
        sub.add_parser(name, help=getattr(ep.load(), "help", None))
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    ap = build_parser(command)
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
        from leanstream_ggml.errors import describe

        line = describe(e)      # OS errors, bad model directories, parameters, corrupt files
        if line is None:
            raise               # a bug: keep the traceback
        print(f"leanstream {args.command}: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
