"""The native interface tested from C (native/tests/test_api.c): a host that is not Python gets
the same ABI, statuses and messages the binding relies on. And the kernels from C
(native/tests/test_kernels.c): every kernel on every instruction set this CPU runs against the
scalar C, the rows kernels against the one-row kernels (the same program runs on aarch64 under
qemu-user: tests/native/test_cross.py)."""

from __future__ import annotations

import shutil

import pytest

from c_tests import build, run


def _build_and_run(name: str, tmp_path, *args: str, env: dict | None = None):
    return run([build(name, tmp_path), *args], env=env, timeout=120)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on PATH")
def test_c_api(tmp_path):
    _build_and_run("test_api", tmp_path, str(tmp_path))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on PATH")
@pytest.mark.parametrize("isa", ["", "scalar"])   # the CPU's best; everything scalar, the CRC table too
def test_kernels_in_c(tmp_path, isa):
    r = _build_and_run("test_kernels", tmp_path, env={"LEANSTREAM_ISA": isa})
    first = next(line for line in r.stdout.splitlines() if line.startswith("kernels: "))
    want = ("scalar",) if isa else ("avx2", "avx512", "avx512vnni", "neon", "neon+dotprod")
    assert first.split()[1] in want and "(" not in first, first
