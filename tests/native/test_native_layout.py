"""native/src is layered: no two files call each other, directly or around a loop (each file's
place is listed in src/internal.h). Checked on the object files of the library this checkout
built, from the symbols each defines and uses (nm), so the check sees the real calls."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _objects() -> list[Path]:
    found = sorted(ROOT.glob("build/native-*/CMakeFiles/leanstream.dir/src/*.c.o"))
    if not found:
        pytest.skip("native object files not found (build with `python -m leanstream_ggml.build`)")
    newest = max(p.parent for p in found)  # the latest build key's folder
    return sorted(p for p in found if p.parent == newest)


def _symbols(obj: Path, *flags: str) -> set[str]:
    out = subprocess.run(["nm", *flags, str(obj)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def file_graph() -> dict[str, set[str]]:
    objs = _objects()
    defined = {o.name[:-2]: _symbols(o, "-g", "--defined-only") for o in objs}
    owner = {sym: f for f, syms in defined.items() for sym in syms}
    graph = {}
    for o in objs:
        f = o.name[:-2]
        graph[f] = {owner[s] for s in _symbols(o, "-u") if s in owner and owner[s] != f}
    return graph


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) not installed")
def test_native_files_call_each_other_without_loops():
    graph = file_graph()
    assert len(graph) >= 8, sorted(graph)
    # depth-first search for a cycle
    state, path = {}, []

    def visit(f):
        state[f] = 1
        path.append(f)
        for g in sorted(graph[f]):
            if state.get(g) == 1:
                cycle = path[path.index(g):] + [g]
                pytest.fail("native files call each other in a loop: " + " -> ".join(cycle))
            if g not in state:
                visit(g)
        path.pop()
        state[f] = 2

    for f in sorted(graph):
        if f not in state:
            visit(f)
    assert not graph["util.c"] and not graph["kernels.c"], "util.c and kernels.c are leaves"
