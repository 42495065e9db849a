"""What the bench scripts share, so each says only what it measures.

    ap = benchkit.parser(__doc__, child=True)              # argparse with the script's doc; --child
    benchkit.flags(ap, "memory_budget", "sparsity", sweep=("sparsity",), defaults={"sparsity": [0.3]})
    if args.child:                                         # the run, in the fresh process
        return benchkit.answer_child(args.child, child)
    out, r = benchkit.run_child(__file__, run_args, limit_bytes=benchkit.regime_limit("1000MB"))
    return benchkit.emit(doc, args.out)                    # the one JSON document (and --out)

- Engine options are flags as options.py declares them (its "script" command: any Llama option,
  by name): one value, or a sweep of several (``sweep``: each value is run); a script's own
  setting of one (``defaults``) shows in its help. No script declares an option's flag itself
  (tests/unit/test_options.py).
- A run in a fresh process: the script again with ``--child JSON`` (its arguments), in its own
  memory cgroup of exactly the regime's bytes where it is a whole-process limit
  (leanstream_tools.cgroup); the child prints its result as its last stdout line.
- Output: one JSON document printed (indent 1) and written to --out; or JSON lines (``Lines``),
  each printed and appended to --out as it comes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:      # the library and its tools, run from a checkout
    sys.path.insert(0, str(REPO))

CHILD = "--child"


def parser(doc: str, *, child: bool = False) -> argparse.ArgumentParser:
    """A script's parser: its docstring as the help; with ``--child JSON`` (hidden) where it runs
    itself in fresh processes."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if child:
        ap.add_argument(CHILD, dest="child", default=None, help=argparse.SUPPRESS)
    return ap


def flags(ap, *names: str, sweep: tuple[str, ...] = (), defaults: dict | None = None) -> None:
    """Engine options ``names`` as flags, from the option table (options.add_flags, the "script"
    command); ``sweep``: those taking one or more values; ``defaults``: the script's own settings."""
    from leanstream_ggml import options

    options.add_flags(ap, options.SCRIPT, names=names, sweep=sweep, defaults=defaults)


def regime_limit(regime: str) -> int | None:
    """The bytes of a whole-process limit ("1000MB"), or None for a regime that sets no cgroup:
    "ram" (no limit), "35%" (a share of the FFN as the engine's budget), "budget=415MB"."""
    from leanstream_ggml.native import params

    if regime == "ram" or regime.endswith("%") or regime.startswith("budget="):
        return None
    return params.size_bytes(regime, "regime")


def run_child(script, a: dict, *, limit_bytes: int | None = None, timeout_s: float = 1800,
              account: bool = False):
    """``script --child JSON(a)`` in a fresh process (in a memory cgroup of ``limit_bytes`` where
    given): (its last stdout line as JSON, or {"error": "status: its last stderr line"}; the
    cgroup.run_command result, for peak memory and wall time)."""
    from leanstream_tools import cgroup

    cmd = [sys.executable, str(Path(script).resolve()), CHILD, json.dumps(a)]
    r = cgroup.run_command(cmd, limit_bytes=limit_bytes, timeout_s=timeout_s, account=account)
    if r.status != "ok":
        return {"error": f"{r.status}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}"}, r
    return json.loads(r.stdout.strip().splitlines()[-1]), r


def answer_child(spec: str, fn) -> int:
    """The child's side of run_child: ``fn`` on the run's arguments, its result the last stdout line."""
    print(json.dumps(fn(json.loads(spec))))
    return 0


def build_c(source: Path, out_dir: Path, *cflags: str) -> Path:
    """A bench C program (bench/NAME.c) compiled into out_dir with $CC (else cc or gcc) -O2 and cflags."""
    import os
    import shutil
    import subprocess

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise SystemExit(f"{source.stem}: no C compiler (cc or gcc) on PATH; set CC")
    exe = Path(out_dir) / source.stem
    subprocess.run([cc, "-O2", *cflags, "-o", str(exe), str(source)], check=True)
    return exe


def emit(doc: dict, out=None) -> int:
    """Print the script's one JSON document, and write it to ``out`` too when given; exit status 0."""
    text = json.dumps(doc, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0


class Lines:
    """JSON lines: each row printed as it comes and appended to ``out`` (when given)."""

    def __init__(self, out=None):
        self.file = open(out, "a") if out else None

    def __call__(self, row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
