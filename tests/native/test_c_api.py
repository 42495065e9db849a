"""The native interface tested from C (native/tests/test_api.c): a host that is not Python gets
the same ABI, statuses and messages the binding relies on. And the kernels from C
(native/tests/test_kernels.c): every kernel on every instruction set this CPU runs against the
scalar C, the rows kernels against the one-row kernels (the same program runs on aarch64 under
qemu-user: tests/native/test_cross.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "native" / "tests"


def _dirs() -> tuple[Path, Path]:
    """(libleanstream's folder, the ggml libraries' folder it links against)."""
    lean = Path(importlib.util.find_spec("leanstream_ggml").origin).parent / "_lib"
    ggml = Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib"
    return lean, ggml


def _build_and_run(source: Path, tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Compile a C test against the installed libleanstream and run it; it must report no failure."""
    lean, ggml = _dirs()
    if not (lean / "libleanstream.so").exists():
        pytest.skip("libleanstream.so is not built (python -m leanstream_ggml.build)")
    exe = tmp_path / source.stem
    subprocess.run(["cc", "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{REPO / 'native' / 'include'}",
                    str(source), f"-L{lean}", "-lleanstream", f"-Wl,-rpath,{lean}:{ggml}", "-lm", "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{lean}:{ggml}", **(env or {}))
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    assert "0 failure(s)" in r.stdout and "FAIL" not in r.stdout
    return r


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on PATH")
def test_c_api(tmp_path):
    _build_and_run(TESTS / "test_api.c", tmp_path, str(tmp_path))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on PATH")
@pytest.mark.parametrize("isa", ["", "scalar"])   # the CPU's best; everything scalar, the CRC table too
def test_kernels_in_c(tmp_path, isa):
    r = _build_and_run(TESTS / "test_kernels.c", tmp_path, env={"LEANSTREAM_ISA": isa})
    first = next(line for line in r.stdout.splitlines() if line.startswith("kernels: "))
    want = ("scalar",) if isa else ("avx2", "avx512", "neon", "neon+dotprod")
    assert first.split()[1] in want and "(" not in first, first
