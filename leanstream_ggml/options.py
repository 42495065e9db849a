"""Every engine option, declared once: the table each front end is made from.

An ``Option`` is a ``Llama`` keyword: its type, its default (None: the engine's own, which
ls_engine_params_init and the mode table in native/src/mode.c define, or a rule between options
that params.py applies), its help and the commands that take it as a flag, spelt
``--name-with-dashes``. Its check is params.py's (``params.CHECKS``, by the option's name; a bad
value raises ParameterError naming it, so a keyword and a flag fail with the same message):
params.py reads this table, this module imports nothing of params.py. From this table come ``Llama``'s keywords,
signature and docstring (llama.py), ``params.engine_params`` and ``params.llama_options``, the
flags of ``leanstream chat``, ``serve`` and ``info``, and every tool's flags:

    add_flags(parser, "bench")              # the options of one command, as flags
    Llama(path, **given(args, "bench"))     # the ones the user set (the others: Llama's defaults)

A command whose flag means something narrower (compare's --memory-limit is the memory cgroup of
each run) or has a default of its own says so in ``variants``. A help text names another option
as ``{name}``: the keyword in the docstring, the flag on a command line; and what the engine
defines as ``{MODES}``, ``{DEFAULT}``, ``{QUALITY}`` (modes.py), ``{MOE_HOT_FRACTION}`` (native/moe.py), ``{MAX_N_IO_THREADS}`` and
``{ENGINE_n_io_threads}`` (ls_engine_params_init), and a mode's own default as
``{name@mode}`` (``{hot_fraction@leanstream+predictors}``: with predictors; ``{sparsity@sparse}``:
every sparse mode's, one number where they agree), which the engine resolves
(ls_engine_params_resolve): no default is written here. They are read when a help is shown:
importing this module loads no native library (`leanstream convert`'s parser takes info's
--memory-limit).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass, field

# the most rows a speculative verify pass decodes: llama.cpp holds that many rows of logits twice,
# memory a limit takes from the FFN cache (bench/results: the rows the controller chose)
VERIFY_ROWS = 16

# the commands that take options: the library's front ends, then the tools (leanstream_tools/,
# bench/serve_load.py), which build their parsers from this table too
COMMANDS = ("chat", "serve", "info", "bench", "perplexity", "eval", "compare", "tune", "serve_load", "convert", "script")
SCRIPT = "script"   # a bench/ script: any Llama option it names (add_flags(ap, SCRIPT, names=...))
_RUNS = ("chat", "serve", "bench", "perplexity", "eval")   # the commands that run a model as Llama does


@dataclass(frozen=True)
class Variant:
    """What an option is on one command, where that differs: its help, its flag's default."""
    help: str | None = None        # None: the option's
    default: object = None         # the flag's default there (None: not given, Llama's default)


@dataclass(frozen=True)
class Option:
    name: str                      # the Llama keyword; the flag is --name-with-dashes
    type: object                   # the value's type, as Llama's signature shows it
    default: object                # Llama's default; None: the engine's (or params.py's rule)
    help: str
    commands: tuple[str, ...]      # the commands that take it as a flag
    llama: bool = True             # a Llama keyword (False: the server's own)
    engine: bool = False           # passed on to FFNEngine by name (params.engine_params)
    variants: dict = field(default_factory=dict)   # command -> Variant

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, text: str):
        """A command-line string as a value: sizes stay strings (their check parses them)."""
        return self.type(text) if self.type in (int, float) else text


_SIZE = int | str

OPTIONS: tuple[Option, ...] = (
    Option("memory_budget", _SIZE, None,
           "bytes of FFN weights kept in RAM (the cache, sketch and predictors): an int, or a size like 512MiB "
           "or 1.5GB; default: all of them",
           _RUNS + ("tune", "serve_load"), engine=True,
           variants={"tune": Variant("the FFN engine's budget: bytes (400MB) or a share of the FFN on disk (35%)"),
                     "serve_load": Variant("the server's FFN budget", "64MiB")}),
    Option("memory_limit", _SIZE, None,
           "instead of {memory_budget}, a limit for the whole process (e.g. 1000MB, what a memory cgroup or a "
           "small machine allows): the memory plan (memplan.py) takes from it what the process needs besides "
           "the FFN engine (the interpreter, the non-FFN weights each token reads, KV cache at n_ctx, "
           "llama.cpp's heap and compute buffers) and gives the rest to the engine, or refuses with its "
           "numbers (MemoryPlanError, a ValueError; `leanstream info MODEL --memory-limit 1000MB` prints it). "
           "Default, with no {memory_budget} either: what the machine or its memory cgroup allows, where the "
           "whole model does not fit in it (below it, nothing streams)",
           _RUNS + ("compare", "tune", "serve_load", "info", "convert"),
           variants={"compare": Variant("whole-process memory limit of every run, e.g. 1GB or 900MiB (default: none)"),
                     "convert": Variant("memory the whole conversion holds, e.g. 1GB or 700MiB (default: what the "
                                        "machine or its memory cgroup allows, printed before the first stage); the "
                                        "model runs through the plugin's dense engine within it, and a limit too small "
                                        "for one layer is refused with the numbers"),
                     "tune": Variant("the whole process's memory limit (the engine gets what the memory plan leaves)"),
                     "serve_load": Variant("whole-process limit of the server (cgroup)", "600MB"),
                     "info": Variant("also print the memory plan under this whole-process limit (e.g. 1000MB): "
                                     "what the process needs besides the FFN engine, and the engine's budget")}),
    Option("mode", str, None,
           "one of {MODES}. {DEFAULT}: every neuron (reproduces stock llama.cpp); the others decode "
           "sparse, computing only the top (1 - sparsity) of each layer's neuron blocks: leanstream (with "
           "the converter's sketch, the default conversion: chosen from each layer's own input: sketch scores "
           "pick candidates, their exact gate/up values pick the blocks whose down columns are computed; "
           "without one, by the predictors; the predictors, if trained, prefetch the next layer), oneshot "
           "(DejaVu: one layer-ahead prediction, no weight cache), dejavu+ (oneshot + LRU cache), powerinfer2 "
           "(hot blocks pinned + LRU); these three need predictors. Prefill is always dense. Default: "
           "{DEFAULT}, or {QUALITY} when {quality} is given",
           _RUNS + ("info",), engine=True,
           variants={"info": Variant("the plan's mode (default: dense, as Llama's)")}),
    Option("sparsity", float, None,
           "fraction of each layer's blocks skipped per decoded token in the sparse modes, in [0, 1) "
           "(default: the engine's, {sparsity@sparse})",
           _RUNS + ("compare", "tune"), engine=True,
           variants={"compare": Variant("sparse setups without a quality preset: fraction of blocks skipped "
                                        "(default: the engine's)")}),
    Option("quality", str, None,
           "instead of {sparsity}, the perplexity the user accepts to lose, e.g. ppl+5%: "
           "{QUALITY} mode (implied) at the largest sparsity whose cost the converter's calibration "
           "measured within that in its worst domain (`leanstream info` shows the table)",
           _RUNS + ("tune",)),
    Option("n_io_threads", int, None,
           "I/O worker threads: reads in flight, 1..{MAX_N_IO_THREADS} (default {ENGINE_n_io_threads})",
           ("serve",), engine=True),
    Option("hot_fraction", float, None,
           "powerinfer2 and leanstream: share of the budget pinned for the blocks most often active in "
           "calibration, in [0, 1] (default: the mode's: powerinfer2 {hot_fraction@powerinfer2+predictors}; "
           "leanstream {hot_fraction@leanstream+predictors} with predictors, {hot_fraction@leanstream} without; "
           "0 pins nothing); mixture-of-experts models: the share of the expert cache pinned for the experts "
           "the conversion saw routed to most often (default {MOE_HOT_FRACTION})",
           ("serve",), engine=True),
    Option("candidate_ratio", float, None,
           "leanstream mode with a sketch: blocks whose gate/up rows are computed exactly per token, as a "
           "multiple of the kept blocks (default: the engine's, {candidate_ratio@leanstream})",
           ("serve",), engine=True),
    Option("bridge_bytes", int, None,
           "read planning of the sparse modes: a read goes on through a gap of up to this many bytes of "
           "unselected blocks (read and dropped) rather than start another I/O; default: per-I/O time x "
           "bandwidth, measured on the block files at start; 0: never",
           ("serve",), engine=True),
    Option("verify_checksums", bool, True,
           "check every block's CRC-32C as it is read (a mismatch raises LeanstreamError naming the file, "
           "layer and block; the model directory's other files are checked against the manifest's checksums "
           "when it is opened); off only to measure what the check costs",
           ("bench", "perplexity", "eval"), engine=True),
    Option("read_ahead", str, "off",
           "mixture-of-experts models: while a layer computes, read the experts the next layer's router "
           "picks from this layer's input: off (default: on 2 cores and a disk the decode waits on it cost more "
           "than it saved, bench/results), auto (each layer's reads stop while fewer than 9 in 10 of them are "
           "used, and start again when more are), on; stats() reports each layer's recall, precision and "
           "wasted bytes",
           _RUNS),
    Option("expert_cache", str, "lfu",
           "mixture-of-experts models: which cached expert gives way to a new one: lfu (the one routed to "
           "least often, counted from the conversion's routing pass on) or lru (the least recently used)",
           _RUNS),
    Option("controller", str, "off",
           "the streaming controller of leanstream mode's decode ops: off (the fixed settings above), table "
           "(the policy `leanstream tune` wrote into the model directory for this budget and sparsity: per "
           "layer, its remaining load and the disk's speed pick the candidate ratio and bridge), or fixed:K "
           "(action K of that policy's actions, or of control.DEFAULT_ACTIONS where none was tuned, on every "
           "layer)",
           ("chat", "serve")),
    Option("in_ram", str, "auto",
           "with no {memory_limit} or {memory_budget}, where nothing streams: auto (where llama.cpp repacks the "
           "FFN weights for this CPU, e.g. Q4_K on AVX2, the GGUF the directory was converted from runs on "
           "llama.cpp's own kernels, as llama_cpp.Llama runs it: its speed and answers, no speculation; "
           "elsewhere, or without that file, the op), stream (always the op)",
           ("chat", "serve", "bench", "perplexity", "eval")),
    Option("source", str, None,
           "the GGUF the model directory was converted from, for {in_ram}=auto (default: the file the "
           "manifest names, beside the directory or in the model cache); its size and sha256 are checked",
           ("chat", "serve", "bench", "perplexity", "eval")),
    Option("speculative", str, "auto",
           "exact speculative decoding in {DEFAULT} mode (docs/design.md §21): auto (drafts from the "
           "engine's resident blocks and from prompt lookup in one token tree verified in one pass, the "
           "controller choosing how far to draft and which tokens to verify, drafting nothing where a pass "
           "of several rows does not pay), self (the resident-block draft only), ngram (prompt lookup "
           "only), off (in the sparse modes always; auto drafts nothing on a model with a recurrent state, "
           "from which llama.cpp cannot drop a rejected draft, and stats()[\"speculative_reason\"] says so). "
           "Every emitted token is sampled from the model's own "
           "logits, so answers are plain decoding's; stats()[\"speculative\"] counts passes, drafted and "
           "accepted tokens, tokens per pass by tree shape, draft and verify time",
           ("chat", "serve", "bench", "eval")),
    Option("draft_max", int, 8,
           "speculative decoding: the self draft's most steps (the deepest tree), and prompt lookup's longest "
           "proposal",
           ("chat", "serve", "bench", "eval")),
    Option("draft_width", int, 3,
           "speculative decoding: the self draft's best tokens per step that a token tree may verify "
           f"(1: a chain); the verify pass has at most 1 + {{draft_max}} x {{draft_width}} rows, {VERIFY_ROWS} at most",
           ("chat", "serve", "bench", "eval")),
    Option("draft_fraction", float, None,
           "speculative decoding: the self draft computes each layer's most important fraction of its blocks "
           "(those resident; 1: every resident block); default: the controller's choice among shares of what "
           "RAM holds (a smaller draft steps faster and agrees less), by the rate it measures for each",
           ("chat", "serve", "bench", "eval")),
    Option("draft_stop", str, None,
           "speculative decoding: how far to draft: controller (default: the table solved from the costs and "
           "acceptance this process measures), fixed (always {draft_max}), p_min:X (stop below the draft's "
           "top-1 probability X, as llama.cpp does)",
           ("chat", "serve", "bench", "eval")),
    Option("reuse_prefix", bool, False,
           "evaluate only what a prompt adds to the previous request's (faster for chats; an answer may then "
           "differ in rounding from the same request alone); off: every request starts from an empty context",
           ("serve",), llama=False),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
LLAMA: tuple[Option, ...] = tuple(o for o in OPTIONS if o.llama)       # Llama's keywords, in this order
ENGINE: tuple[str, ...] = tuple(o.name for o in OPTIONS if o.engine)   # FFNEngine's, by the same names


class _SettingsBase:
    """Read access by name (``s["mode"]``, as the tables name options) and ``replace``; the fields
    are Llama's options (LLAMA), frozen."""

    def __getitem__(self, name: str):
        return getattr(self, name)

    def replace(self, **changes):
        """A copy with ``changes``: what a later step (the memory plan, a backend) decided."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# Every Llama option's value, once checked (params.llama_options builds it): one immutable object
# from what the user gave, replaced, never changed, by what the plan and the backend decide.
Settings = dataclasses.make_dataclass(
    "Settings", [(o.name, o.type, field(default=o.default)) for o in LLAMA], bases=(_SettingsBase,),
    frozen=True)
Settings.__module__ = __name__


def for_command(command: str) -> list[Option]:
    if command not in COMMANDS:
        raise ValueError(f"no command {command!r} takes engine options (known: {', '.join(COMMANDS)})")
    if command == SCRIPT:
        return list(LLAMA)
    return [o for o in OPTIONS if command in o.commands]


# ---- the front ends ---------------------------------------------------------------------------

class _Names(dict):
    """What a help text's {NAME}s stand for, looked up when one is shown."""

    def __init__(self, style: str):
        super().__init__()
        self.style = style

    def __missing__(self, key: str):
        if key in BY_NAME:
            return key if self.style == "doc" else BY_NAME[key].flag
        from leanstream_ggml.native import _native, modes

        if "@" in key:                  # a mode's default, as the engine resolves it
            return _mode_default(*key.split("@"))
        if key.startswith("ENGINE_"):   # a default ls_engine_params_init sets outright
            p = _native.ffi.new("ls_engine_params *")
            _native.lib.ls_engine_params_init(p)
            return getattr(p, key[len("ENGINE_"):])
        return {"MODES": lambda: ", ".join(modes.MODES), "DEFAULT": lambda: modes.DEFAULT,
                "QUALITY": lambda: modes.QUALITY, "MAX_N_IO_THREADS": lambda: _native.lib.LS_MAX_IO_THREADS,
                "MOE_HOT_FRACTION": _moe_hot_fraction}[key]()


def _moe_hot_fraction() -> float:
    from leanstream_ggml.native.moe import MOE_HOT_FRACTION

    return MOE_HOT_FRACTION


def _mode_default(name: str, which: str) -> str:
    """``{name@mode}`` of a help: the engine's default of parameter ``name`` in a mode ("+predictors":
    with predictors), or in every sparse mode ("sparse": one value where all agree, else each mode's)."""
    from leanstream_ggml.native import _native, modes

    mode, _, extra = which.partition("+")
    predictors = extra == "predictors"
    if mode != "sparse":
        return f"{_native.mode_defaults(mode, predictors)[name]:g}"
    got = {m: f"{_native.mode_defaults(m, predictors)[name]:g}" for m in modes.SPARSE}
    values = set(got.values())
    return values.pop() if len(values) == 1 else ", ".join(f"{m} {v}" for m, v in got.items())


def _text(o: Option, help: str, style: str) -> str:
    """help with its {name}s filled in (an option: the keyword, style "doc", or the flag, style
    "flag"), and the default where the option has one of its own."""
    text = help.format_map(_Names(style))
    if o.default is not None:
        shown = (repr(o.default) if style == "doc" else ("on" if o.default else "off") if o.type is bool
                 else o.default)
        text += f" (default: {shown})"
    return text


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, command: str,
              names: tuple[str, ...] | None = None, *, sweep: tuple[str, ...] = (),
              defaults: dict | None = None) -> None:
    """The flags of ``command``'s options (only ``names`` of them, if given), each with default
    None unless the command's variant has one, so that ``given`` sees what the user set.
    ``sweep``: the options whose flag takes one or more values (a list: a bench script that runs
    each); ``defaults``: the caller's own defaults where it has them (a bench script's setting,
    shown in the help), over the variant's."""
    options = for_command(command)
    defaults = defaults or {}
    if names is not None:
        missing = set(names) - {o.name for o in options}
        if missing:
            raise ValueError(f"{command} takes no option {', '.join(sorted(missing))}")
        options = [o for o in options if o.name in names]
    unknown = (set(sweep) | set(defaults)) - {o.name for o in options}
    if unknown:
        raise ValueError(f"sweep or defaults name options not added here: {', '.join(sorted(unknown))}")
    for o in options:
        v = o.variants.get(command, Variant())
        default = defaults.get(o.name, v.default)
        help = _text(o, o.help if v.help is None else v.help, "flag")
        if default is not None:
            shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
            help += f" (default{' here' if o.name in defaults else ''}: {shown})"
        if o.name in sweep:
            help += " (one or more values: each is run)"
        kw = dict(dest=o.name, default=default, help=help.replace("%", "%%"))
        if o.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = o.parse
            if o.name in sweep:
                kw["nargs"] = "+"
        parser.add_argument(o.flag, **kw)


def given(args: argparse.Namespace, command: str) -> dict:
    """The options of ``command`` the user gave (name -> value; a command's own default counts)."""
    return {o.name: getattr(args, o.name) for o in for_command(command) if getattr(args, o.name, None) is not None}


def parameters() -> list[inspect.Parameter]:
    """Llama's keyword-only parameters, with their types and defaults (Llama.__init__.__signature__)."""
    return [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default,
                              annotation=o.type if o.default is not None else o.type | None) for o in LLAMA]


def docstring(indent: int = 8, width: int = 100) -> str:
    """Llama's option list: one "name: help" entry per keyword, as an Args section writes it."""
    pad = " " * indent
    return "\n".join(textwrap.fill(f"{o.name}: {_text(o, o.help, 'doc')}.", width, initial_indent=pad,
                                   subsequent_indent=pad + "    ") for o in LLAMA)
