"""Each engine option declared once (leanstream_ggml/options.py): Llama's keywords, signature and
docstring, the checks, every command's flags and README's list are made from, or checked against,
that one table; no front end declares an option's flag itself or compares a mode's name."""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from leanstream_ggml.native import modes, params
from leanstream_ggml import options

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("memory_budget", "memory_limit", "mode", "sparsity", "quality", "n_io_threads", "hot_fraction",
         "candidate_ratio", "bridge_bytes", "verify_checksums", "read_ahead", "expert_cache", "controller", "in_ram", "source", "speculative", "draft_max",
         "draft_width", "draft_fraction", "draft_stop")


def _parse(command: str, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=command, exit_on_error=False)
    options.add_flags(p, command)
    return p.parse_args(argv)


def test_the_spec_names_every_engine_option_once():
    assert tuple(o.name for o in options.LLAMA) == NAMES
    assert [o.name for o in options.OPTIONS if not o.llama] == ["reuse_prefix"]   # the server's own
    assert len(options.BY_NAME) == len(options.OPTIONS)
    for o in options.OPTIONS:
        assert o.help and o.commands and set(o.commands) <= set(options.COMMANDS), o.name
        assert set(o.variants) <= set(o.commands), o.name
        assert o.flag == "--" + o.name.replace("_", "-")
    # the engine's own options, by FFNEngine's names
    assert options.ENGINE == ("memory_budget", "mode", "sparsity", "n_io_threads", "hot_fraction",
                              "candidate_ratio", "bridge_bytes", "verify_checksums")


def test_every_option_has_one_check():
    """The table (options.py) and the checks (params.py) name the same options: one owns each,
    and params.py reads the table (no import circle: tests/unit/test_walls.py)."""
    assert set(params.CHECKS) == set(options.BY_NAME)
    assert params.CHECKS["memory_limit"]("1GB") == 10**9
    with pytest.raises(params.ParameterError, match="^memory_limit: "):
        params.CHECKS["memory_limit"]("lots")


def test_llama_signature_and_docstring_are_the_spec():
    from leanstream_ggml import Llama

    ps = inspect.signature(Llama.__init__).parameters
    ours = [p for p in ps.values() if p.kind is p.KEYWORD_ONLY]
    assert [p.name for p in ours] == list(NAMES)
    for p in ours:
        o = options.BY_NAME[p.name]
        assert p.default == o.default and p.annotation == (o.type if o.default is not None else o.type | None)
    assert list(ps)[:2] == ["self", "model_path"] and list(ps)[-1] == "kwargs"
    doc = Llama.__doc__
    assert "{options}" not in doc
    for name in NAMES:
        assert re.search(rf"^        {name}: \S", doc, re.M), name
    text = " ".join(doc.split())
    assert "instead of sparsity, the perplexity" in text              # {sparsity} as the keyword
    assert "(default: 8)" in text and "(default: True)" in text       # defaults from the spec


def test_each_command_takes_exactly_its_options():
    want = {
        "chat": {"memory_budget", "memory_limit", "mode", "sparsity", "quality", "read_ahead", "expert_cache", "controller", "in_ram", "source",
                 "speculative",
                 "draft_max", "draft_width", "draft_fraction", "draft_stop"},
        "serve": set(NAMES) - {"verify_checksums"} | {"reuse_prefix"},
        "info": {"memory_limit", "mode"},
        "bench": {"memory_budget", "memory_limit", "mode", "sparsity", "quality", "verify_checksums", "read_ahead", "expert_cache", "in_ram",
                  "source",
                  "speculative", "draft_max", "draft_width", "draft_fraction", "draft_stop"},
        "perplexity": {"memory_budget", "memory_limit", "mode", "sparsity", "quality", "verify_checksums", "read_ahead", "expert_cache",
                       "in_ram", "source"},
        "eval": {"memory_budget", "memory_limit", "mode", "sparsity", "quality", "verify_checksums", "read_ahead", "expert_cache", "in_ram",
                 "source",
                 "speculative", "draft_max", "draft_width", "draft_fraction", "draft_stop"},
        "compare": {"memory_limit", "sparsity"},
        "tune": {"memory_budget", "memory_limit", "sparsity", "quality"},
        "serve_load": {"memory_budget", "memory_limit"},
        "convert": {"memory_limit"},
        "script": set(NAMES),    # a bench/ script: any Llama option, by name
    }
    assert set(want) == set(options.COMMANDS)
    for command, names in want.items():
        assert {o.name for o in options.for_command(command)} == names, command
    with pytest.raises(ValueError, match="no command 'bogus'"):
        options.for_command("bogus")


def test_flags_give_only_what_the_user_set():
    assert options.given(_parse("serve", []), "serve") == {}
    argv = ["--memory-budget", "512MiB", "--memory-limit", "1GB", "--mode", "leanstream", "--sparsity", "0.4",
            "--quality", "ppl+5%", "--n-io-threads", "8", "--hot-fraction", "0.25", "--candidate-ratio", "2",
            "--bridge-bytes", "4096", "--controller", "table", "--speculative", "auto", "--draft-max", "4",
            "--draft-fraction", "0.5", "--draft-stop", "fixed", "--reuse-prefix"]
    got = options.given(_parse("serve", argv), "serve")
    assert got == {"memory_budget": "512MiB", "memory_limit": "1GB", "mode": "leanstream", "sparsity": 0.4,
                   "quality": "ppl+5%", "n_io_threads": 8, "hot_fraction": 0.25, "candidate_ratio": 2.0,
                   "bridge_bytes": 4096, "controller": "table", "speculative": "auto", "draft_max": 4,
                   "draft_fraction": 0.5, "draft_stop": "fixed", "reuse_prefix": True}
    # a boolean option off, as a flag
    assert options.given(_parse("bench", ["--no-verify-checksums"]), "bench") == {"verify_checksums": False}
    assert options.given(_parse("bench", ["--verify-checksums"]), "bench") == {"verify_checksums": True}
    # a command's own default counts as given (serve_load's server limits)
    assert options.given(_parse("serve_load", []), "serve_load") == {"memory_budget": "64MiB",
                                                                     "memory_limit": "600MB"}
    # a command takes only its own options
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        _parse("chat", ["--n-io-threads", "8"])


def test_add_flags_can_take_a_subset_into_a_group():
    """tune's --memory-limit and --memory-budget are one choice: a group takes those two only."""
    p = argparse.ArgumentParser(exit_on_error=False)
    g = p.add_mutually_exclusive_group(required=True)
    options.add_flags(g, "tune", names=("memory_limit", "memory_budget"))
    options.add_flags(p, "tune", names=("sparsity", "quality"))
    assert options.given(p.parse_args(["--memory-budget", "35%"]), "tune") == {"memory_budget": "35%"}
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        p.parse_args(["--memory-budget", "35%", "--memory-limit", "1GB"])
    with pytest.raises(ValueError, match="tune takes no option controller"):
        options.add_flags(argparse.ArgumentParser(), "tune", names=("controller",))


def test_a_script_sweeps_an_option_with_its_own_defaults():
    """A bench script's flags (the "script" command): a sweep takes one or more values, each parsed
    as the option's type; a script's own default shows in the help and counts as given."""
    p = argparse.ArgumentParser(exit_on_error=False, formatter_class=lambda prog: argparse.HelpFormatter(prog, width=400))
    options.add_flags(p, options.SCRIPT, names=("mode", "sparsity", "memory_budget"), sweep=("mode", "sparsity"),
                      defaults={"sparsity": [0.3, 0.5]})
    a = p.parse_args(["--mode", "dense", "leanstream", "--memory-budget", "1GB"])
    assert a.mode == ["dense", "leanstream"] and a.sparsity == [0.3, 0.5] and a.memory_budget == "1GB"
    assert p.parse_args(["--sparsity", "0.7"]).sparsity == [0.7]
    assert p.parse_args([]).mode is None
    text = p.format_help()
    assert "(default here: 0.3 0.5) (one or more values: each is run)" in text
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        p.parse_args(["--sparsity", "lots"])
    with pytest.raises(ValueError, match="not added here: candidate_ratio"):
        options.add_flags(argparse.ArgumentParser(), options.SCRIPT, names=("sparsity",), sweep=("candidate_ratio",))


def test_help_shows_the_spec_and_its_variants():
    p = argparse.ArgumentParser(prog="chat", formatter_class=lambda prog: argparse.HelpFormatter(prog, width=400))
    options.add_flags(p, "chat")
    text = p.format_help()
    assert f"one of {', '.join(modes.MODES)}" in text            # the engine's modes, read when shown
    assert "instead of --sparsity, the perplexity" in text and "e.g. ppl+5%:" in text   # % as written
    assert "(default: off)" in text and "(default: 8)" in text
    c = argparse.ArgumentParser(prog="compare", formatter_class=lambda prog: argparse.HelpFormatter(prog, width=400))
    options.add_flags(c, "compare")
    assert "whole-process memory limit of every run" in c.format_help()
    s = argparse.ArgumentParser(prog="serve", formatter_class=lambda prog: argparse.HelpFormatter(prog, width=400))
    options.add_flags(s, "serve")
    from leanstream_ggml.native import _native

    assert f"reads in flight, 1..{_native.lib.LS_MAX_IO_THREADS} (default 16)" in s.format_help()


def test_mode_defaults_in_the_help_come_from_the_engine(monkeypatch):
    """A mode's defaults (sparsity, the hot set's share, the candidate ratio) are the engine's
    (ls_engine_params_resolve), read when the help is shown; no help text writes a default number."""
    from leanstream_ggml.native import _native

    def shown(command: str) -> str:
        p = argparse.ArgumentParser(prog=command, formatter_class=lambda prog: argparse.HelpFormatter(prog, width=400))
        options.add_flags(p, command)
        return p.format_help()

    d = {m: _native.mode_defaults(m) for m in modes.MODES}
    with_predictors = {m: _native.mode_defaults(m, predictors=True) for m in modes.MODES}
    assert f"in [0, 1) (default: the engine's, {d['leanstream']['sparsity']:g})" in shown("chat")
    serve = shown("serve")
    assert (f"(default: the mode's: powerinfer2 {with_predictors['powerinfer2']['hot_fraction']:g}; leanstream "
            f"{with_predictors['leanstream']['hot_fraction']:g} with predictors, {d['leanstream']['hot_fraction']:g} "
            f"without; 0 pins nothing)") in serve
    assert f"multiple of the kept blocks (default: the engine's, {d['leanstream']['candidate_ratio']:g})" in serve
    for o in options.OPTIONS:
        for text in [o.help] + [v.help for v in o.variants.values() if v.help]:
            assert not re.search(r"default[^)]*?\b(\d*\.\d+|\d{2,})\b", text), (o.name, text)   # 0.5, 16
    # the engine is asked, not a copy: another resolved value shows
    real = _native.mode_defaults
    monkeypatch.setattr(_native, "mode_defaults", lambda m, predictors=False: {**real(m, predictors), "sparsity": 0.25})
    assert "(default: the engine's, 0.25)" in shown("chat")


def test_a_flag_and_a_keyword_fail_with_one_message():
    for argv, name in ((["--sparsity", "1.5"], "sparsity"), (["--mode", "turbo"], "mode"),
                       (["--memory-budget", "lots"], "memory_budget"), (["--draft-max", "0"], "draft_max"),
                       (["--quality", "fast"], "quality"), (["--controller", "sometimes"], "controller")):
        given = options.given(_parse("serve", argv), "serve")
        with pytest.raises(params.ParameterError, match=rf"^{name}: ") as flag:
            params.llama_options(given)
        with pytest.raises(params.ParameterError) as keyword:
            params.llama_options({name: options.BY_NAME[name].parse(argv[1])})
        assert str(flag.value) == str(keyword.value) and flag.value.name == name


def test_rules_between_options():
    v = params.llama_options({})
    assert v["mode"] == modes.DEFAULT and v["controller"] == "off" and v["speculative"] == "auto"
    assert v["draft_max"] == 8 and v["draft_width"] == 3 and v["draft_fraction"] is None and v["verify_checksums"] is True
    assert v["memory_budget"] is None and v["sparsity"] is None          # the engine's defaults
    assert params.llama_options({"quality": "ppl+5%"})["mode"] == modes.QUALITY
    assert params.llama_options({"memory_limit": "1GB"})["memory_limit"] == 10**9
    assert params.llama_options({"mode": "leanstream", "speculative": "auto"})["speculative"] == "off"
    for given, message in (({"quality": "ppl+5%", "sparsity": 0.5}, "^quality: give quality= or sparsity=, not both"),
                           ({"quality": "ppl+5%", "mode": "powerinfer2"}, "^quality: .*mode='powerinfer2' was given"),
                           ({"controller": "table"}, "^controller: steers leanstream mode's decode; mode='dense'"),
                           ({"mode": "oneshot", "speculative": "self"}, "^speculative: verifies drafts with the dense"),
                           ({"memory_limit": "1GB", "memory_budget": "1MB"}, "^memory_limit: .*not both")):
        with pytest.raises(params.ParameterError, match=message):
            params.llama_options(given)
    with pytest.raises(TypeError, match="not an option of Llama: memory_limt"):
        params.llama_options({"memory_limt": "1GB"})
    with pytest.raises(TypeError, match="not an engine parameter: controller"):
        params.engine_params(controller="table")


def test_importing_the_options_loads_no_native_library():
    """`leanstream convert` registers info's flags: building them loads neither libleanstream nor
    llama.cpp (a help that names the engine's modes reads them only when it is shown)."""
    code = ("import argparse, sys\nfrom leanstream_ggml import options\n"
            "options.add_flags(argparse.ArgumentParser(), 'info')\n"
            "bad = [m for m in sys.modules if m in ('llama_cpp', 'leanstream_ggml.native._native', 'cffi')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_readme_lists_exactly_the_options():
    """README's list of Llama's added arguments names every option of the spec and nothing else
    (a backticked word there is an option or a mode); the server's own options are in it too."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("Added arguments")
    section = text[start:text.index("| mode |", start)]
    named = set(re.findall(r"`([a-z][a-z_]*)`", section))
    assert named - set(modes.MODES) == set(NAMES), "README's option list and options.py differ"
    for o in options.OPTIONS:
        if not o.llama:
            assert f"`{o.flag}`" in text, o.flag


# ---- one declaration: no front end adds an option's flag, none compares a mode's name ----------

FRONT_ENDS = ("leanstream_ggml", "leanstream_tools", "leanstream_convert")


def _python_files(*roots: str):
    for root in roots:
        yield from sorted((ROOT / root).rglob("*.py")) if (ROOT / root).exists() else ()


def test_no_front_end_declares_an_option_flag_itself():
    """Front ends and bench/ scripts take engine options from the table (options.add_flags;
    bench/benchkit.py's flags), never by an add_argument of their own."""
    flags = {o.flag for o in options.OPTIONS}
    found = []
    for path in _python_files(*FRONT_ENDS, "bench"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"):
                strings = {a.value for a in node.args if isinstance(a, ast.Constant)}
                if strings & flags:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"flags of options.py declared again: {found}"


def _mode_names_compared(tree: ast.AST):
    def strings(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        return set()

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and set(modes.MODES) & set().union(*map(strings, [node.left,
                                                                                          *node.comparators])):
            yield node


def test_no_mode_name_is_compared():
    """What a mode does is the engine's mode table's to say (modes.py: is_sparse, uses,
    is_cascade); a `mode == "dense"` elsewhere would be a second owner of that policy."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
             for path in _python_files(*FRONT_ENDS, "bench") for node in _mode_names_compared(ast.parse(path.read_text(encoding="utf-8")))]
    assert not found, found


def test_the_mode_compare_check_sees_one():
    tree = ast.parse("if mode != 'dense' or m in ('oneshot', 'x'): pass\nif kind in ('auto', 'self'): pass\n")
    assert [n.lineno for n in _mode_names_compared(tree)] == [1, 1]


def test_server_flags_are_the_spec():
    pytest.importorskip("fastapi", reason="leanstream serve needs the server extra")
    from leanstream_ggml.commands import server

    assert server.LEANSTREAM_OPTIONS == tuple(o.name for o in options.for_command("serve"))
    ns = server.build_parser().parse_args(["model.lsm", "--mode", "leanstream", "--n-io-threads", "4",
                                           "--reuse-prefix", "--n_ctx", "256"])
    assert server.leanstream_options(ns) == {"mode": "leanstream", "n_io_threads": 4, "reuse_prefix": True}
    assert ns.n_ctx == 256 and ns.max_waiting_requests == 8      # theirs, and the server's own
    assert server.leanstream_options(server.build_parser().parse_args(["model.lsm"])) == {}
    with pytest.raises(TypeError, match="unknown leanstream options: memory_limt"):
        server.create_app("model.lsm", memory_limt="1GB")


def test_the_settings_are_one_immutable_object():
    """params.llama_options builds every option once, checked and frozen: what a later step decides
    (the memory plan, a backend) is a replaced copy, never a change in place."""
    import dataclasses

    s = params.llama_options({"memory_limit": "1GB", "speculative": "auto"})
    assert isinstance(s, options.Settings) and s.memory_limit == 10**9 and s["memory_limit"] == 10**9
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.memory_budget = 1
    with pytest.raises(TypeError):
        s["memory_budget"] = 1
    t = s.replace(memory_budget=5, speculative="ngram")
    assert (t.memory_budget, t.speculative, s.memory_budget, s.speculative) == (5, "ngram", None, "auto")
    assert [f.name for f in dataclasses.fields(options.Settings)] == [o.name for o in options.LLAMA]
