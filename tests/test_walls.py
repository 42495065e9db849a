"""The walls that keep the runtime light: the runtime package never imports the converter, and
using it (import, a Llama decode, `leanstream chat -p`) never loads torch, scikit-learn or gguf.
The check runs in a fresh interpreter, so the test session's own imports cannot hide a breach."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "sklearn", "gguf", "converters")


def _imports(path: Path) -> set[str]:
    """Top-level names of every module a file imports (at any depth of its code)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_runtime_sources_never_import_the_converter():
    offenders = {}
    for path in sorted((ROOT / "leanstream_ggml").rglob("*.py")):
        bad = _imports(path) & {"converters", "torch", "sklearn"}
        # gguf-py: only the numpy oracle of the op (tests) may use it, to dequantize weights
        if path.name != "reference.py":
            bad |= _imports(path) & {"gguf"}
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert not offenders, f"the runtime imports converter-side modules: {offenders}"


_PROBE = r"""
import json, sys
import leanstream_ggml
from leanstream_ggml import Llama
from leanstream_ggml.cli import main
model = sys.argv[1]
llm = Llama(model, n_ctx=128, n_threads=2, verbose=False)
llm.eval(llm.tokenize(b"The sky is"))
llm.close()
rc = main(["chat", model, "-p", "Hi", "-n", "4", "--temp", "0", "-c", "128"])
print(json.dumps({"rc": rc, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in %r)}))
""" % (HEAVY,)


@pytest.mark.slow
def test_using_the_runtime_loads_no_converter_dependency(smollm2_dir):
    r = subprocess.run([sys.executable, "-c", _PROBE, str(smollm2_dir)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["rc"] == 0
    assert res["loaded"] == [], f"the runtime loaded {res['loaded']}"
