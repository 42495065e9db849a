"""Test hooks for the engines a Llama creates, in this process or in a child one (the server under
test). FFNEngine takes hooks only as its ``test_hooks`` keyword (the library reads none from the
environment), so a test that cannot pass the keyword itself wraps engine creation:

    with engine_hooks.given({"fault": "eio", "fault_read": 9}):
        llm = Llama(model_dir)          # its engine has the hooks; engines created after it do not

    python tests/support/engine_hooks.py HOOKS.json serve MODEL --port 8000 ...

The second form runs `leanstream` (its arguments after the file) with every engine it creates
given the hooks of HOOKS.json, a file only the test that wrote it names: bench/serve_load.py's
start_server takes it as its launcher.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()


@contextlib.contextmanager
def given(hooks: dict):
    """Engines created inside the block get ``hooks`` (unless given their own)."""
    from leanstream_ggml.native import engine

    cls = engine.FFNEngine
    init = cls.__init__

    def with_hooks(self, *args, test_hooks=None, **kwargs):
        init(self, *args, test_hooks=hooks if test_hooks is None else test_hooks, **kwargs)

    cls.__init__ = with_hooks
    try:
        yield
    finally:
        cls.__init__ = init


def launcher(hooks: dict, directory: Path) -> list[str]:
    """The command that runs `leanstream` with these hooks (its hooks file written in directory)."""
    with tempfile.NamedTemporaryFile("w", dir=directory, prefix="hooks-", suffix=".json", delete=False) as f:
        json.dump(hooks, f)
    return [sys.executable, str(HERE), f.name]


def main(argv: list[str]) -> int:
    from leanstream_ggml.cli import main as leanstream

    hooks = json.loads(Path(argv[0]).read_text())
    with given(hooks):
        return leanstream(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
