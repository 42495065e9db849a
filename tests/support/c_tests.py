"""The C test programs of native/tests/ built for this machine and run: each prints one line per
check and "N failure(s)" at the end (tests/native/test_c_api.py, tests/native/test_cross.py; the
aarch64 builds of the same programs: leanstream_ggml/build.py build_cross_native)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = REPO / "native" / "tests"


def lib_dirs() -> tuple[Path, Path]:
    """(libleanstream's folder, the folder of the libllama and ggml it links against)."""
    lean = Path(importlib.util.find_spec("leanstream_ggml").origin).parent / "_lib"
    ggml = Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib"
    return lean, ggml


def build(name: str, out_dir: Path) -> Path:
    """native/tests/<name>.c compiled against the installed libleanstream and libllama."""
    from leanstream_ggml import build as b

    lean, ggml = lib_dirs()
    if not (lean / "libleanstream.so").exists():
        pytest.skip("libleanstream.so is not built (python -m leanstream_ggml.build)")
    exe = out_dir / name
    subprocess.run(["cc", "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{REPO / 'native' / 'include'}",
                    f"-I{b.llama_build_dir() / 'include'}", str(SOURCES / f"{name}.c"), f"-L{lean}", f"-L{ggml}",
                    "-lleanstream", "-lllama", f"-Wl,-rpath,{lean}:{ggml}", "-lm", "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


def run(cmd, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a C test program (or qemu with one); it must report no failure."""
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, **(env or {})))
    assert r.returncode == 0 and "FAIL" not in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 failure(s)" in r.stdout
    return r
