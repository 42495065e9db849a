"""Engine options as the command lines see them, each declared once.

An option is its ``Llama`` keyword, how a command-line string becomes its value, its help and
the commands that take it. ``add_flags(parser, command)`` adds the flags of one command and
``given(args, command)`` returns the keywords the user set (the others stay ``Llama``'s own
defaults, which params.py and the engine define). Values are validated where ``Llama`` takes
them (params.py), so a command line and a keyword fail with the same message.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    name: str                      # the Llama keyword; the flag is --name-with-dashes
    type: type                     # what argparse converts the string with
    help: str
    commands: tuple[str, ...]      # chat, serve, bench, compare

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_SPEC = ("chat", "serve", "bench", "compare")

OPTIONS: tuple[Option, ...] = (
    Option("speculative", str, "dense mode: exact speculative decoding, drafts from what RAM holds: auto (resident-block "
                               "draft + prompt lookup, the controller choosing how far), self, ngram, off (default)", _SPEC),
    Option("draft_max", int, "speculative decoding: the longest draft (default 8)", _SPEC),
    Option("draft_fraction", float, "speculative decoding: the self draft computes each layer's most important "
                                    "fraction of its blocks (those resident; default 1)", _SPEC),
    Option("draft_stop", str, "speculative decoding: how far to draft: controller (default), fixed (always "
                              "--draft-max), p_min:X (stop below the draft's top-1 probability X)", _SPEC),
)

BY_NAME = {o.name: o for o in OPTIONS}


def for_command(command: str) -> list[Option]:
    return [o for o in OPTIONS if command in o.commands]


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, command: str) -> None:
    for o in for_command(command):
        parser.add_argument(o.flag, dest=o.name, type=o.type, default=None, help=o.help)


def given(args: argparse.Namespace, command: str) -> dict:
    """The options of ``command`` the user gave (name -> value)."""
    return {o.name: getattr(args, o.name) for o in for_command(command) if getattr(args, o.name, None) is not None}
