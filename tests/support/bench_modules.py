"""bench/ scripts imported as modules by the tests (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:   # the scripts import their shared helper (bench/benchkit.py) by name
    sys.path.insert(0, str(BENCH))


def load(name: str):
    """bench/<name>.py as the module bench_<name>, loaded once per test session."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]
