"""The native interface tested from C (native/tests/test_api.c): a host that is not Python gets
the same ABI, statuses and messages the binding relies on."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "native" / "tests" / "test_api.c"


def _dirs() -> tuple[Path, Path]:
    """(libleanstream's folder, the ggml libraries' folder it links against)."""
    lean = Path(importlib.util.find_spec("leanstream_ggml").origin).parent / "_lib"
    ggml = Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib"
    return lean, ggml


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on PATH")
def test_c_api(tmp_path):
    lean, ggml = _dirs()
    if not (lean / "libleanstream.so").exists():
        pytest.skip("libleanstream.so is not built (python -m leanstream_ggml.build)")
    exe = tmp_path / "test_api"
    subprocess.run(["cc", "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{REPO / 'native' / 'include'}",
                    str(SOURCE), f"-L{lean}", "-lleanstream", f"-Wl,-rpath,{lean}:{ggml}", "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{lean}:{ggml}")
    r = subprocess.run([str(exe), str(tmp_path)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 failure(s)" in r.stdout and "FAIL" not in r.stdout
