"""The walls that keep the runtime light: the runtime package never imports the converter, and
using it (import, a Llama decode, `leanstream chat -p`) never loads torch, scikit-learn or gguf.
The check runs in a fresh interpreter, so the test session's own imports cannot hide a breach.
And the runtime holds only what it runs: nothing in it serves only the converter or the tests
(writers and quantizers live in converters/, numpy oracles in tests/reference.py)."""

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
        bad = _imports(path) & set(HEAVY)
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert not offenders, f"the runtime imports converter-side modules: {offenders}"


# ---- the runtime holds only what it runs ---------------------------------------------------------

# Top-level functions and classes of leanstream_ggml/ that nothing in leanstream_ggml/ or bench/
# uses, on purpose (each with why). Everything else the runtime does not use belongs with its
# user: converters/ (writers, quantizers, reading back what they wrote) or tests/ (numpy oracles).
PUBLIC_API = {
    "leanstream_ggml.harness.measure.peak_rss_bytes": "the harness's process counters (the tests read peak RSS with it)",
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_source(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_def(node) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))


def _uses(path: Path, root: Path) -> set[tuple[str, str]]:
    """(module, name) pairs one file uses: what it imports from a module, attributes of the
    modules it imports, and its own top-level names used anywhere in it outside their own
    definition (a function calling only itself is not used)."""
    module, is_package = _module_name(path, root), path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    uses, alias = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _import_source(node, module, is_package)
            for a in node.names:
                uses.add((src, a.name))
                alias[a.asname or a.name] = f"{src}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = []
            while isinstance(node, ast.Attribute):
                chain.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name) and node.id in alias:
                prefix = alias[node.id]
                for attr in reversed(chain):
                    uses.add((prefix, attr))
                    prefix = f"{prefix}.{attr}"
    own = {n.name for n in tree.body if _is_def(n)}
    for stmt in tree.body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and node.id in own and not (_is_def(stmt) and stmt.name == node.id):
                uses.add((module, node.id))
    return uses


def _entry_points(root: Path) -> set[tuple[str, str]]:
    """What is called by name: the `leanstream` script, and the register() of each command module
    the CLI registry names (leanstream_ggml/cli.py COMMANDS)."""
    out = set()
    pyproject = root / "pyproject.toml"
    if pyproject.exists():   # [project.scripts]: name = "module:function" (tomllib is Python >= 3.11)
        section = pyproject.read_text().split("[project.scripts]", 1)[1:]
        for line in section[0].split("\n[", 1)[0].splitlines() if section else ():
            if "=" in line and ":" in line:
                out.add(tuple(line.split("=", 1)[1].strip().strip("\"'").split(":", 1)))
    cli = root / "leanstream_ggml" / "cli.py"
    if cli.exists():
        for node in ast.walk(ast.parse(cli.read_text())):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMMANDS" for t in node.targets):
                for v in node.value.values:
                    out.add((v.elts[0].value, "register"))
    return out


def not_used_by_the_runtime(root: Path = ROOT) -> dict[str, str]:
    """{module.name: "path:line"} for every top-level function and class of root/leanstream_ggml
    that nothing in leanstream_ggml/ or bench/ uses (dunders aside: protocol methods)."""
    pkg = root / "leanstream_ggml"
    defs = {}
    for path in sorted(pkg.rglob("*.py")):
        module = _module_name(path, root)
        for n in ast.parse(path.read_text(), str(path)).body:
            if _is_def(n) and not (n.name.startswith("__") and n.name.endswith("__")):
                defs[(module, n.name)] = f"{path.relative_to(root)}:{n.lineno}"
    used = _entry_points(root)
    for folder in (pkg, root / "bench"):
        for path in sorted(folder.rglob("*.py")) if folder.is_dir() else ():
            used |= _uses(path, root)
    return {f"{m}.{n}": where for (m, n), where in sorted(defs.items()) if (m, n) not in used}


def test_the_runtime_holds_only_what_it_runs():
    unused = not_used_by_the_runtime()
    extra = {name: where for name, where in unused.items() if name not in PUBLIC_API}
    assert not extra, (
        "defined in the runtime but used only by the converter or the tests (or by nothing): "
        + ", ".join(f"{name} ({where})" for name, where in extra.items())
        + ". Writers and quantizers belong in converters/, numpy oracles in tests/reference.py; "
          "public API goes on PUBLIC_API in tests/test_walls.py, with why")
    stale = sorted(set(PUBLIC_API) - set(unused))
    assert not stale, f"PUBLIC_API lists names the runtime now uses, or that no longer exist: {stale}; remove them"


def test_the_runtime_wall_sees_a_converter_only_helper(tmp_path):
    """The check above is not vacuous: a helper the runtime defines and only the converter and the
    tests use is reported; one the runtime uses is not, nor a function of the runtime's own."""
    (tmp_path / "leanstream_ggml").mkdir()
    (tmp_path / "converters").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "leanstream_ggml" / "__init__.py").write_text("from .mod import run\n")
    (tmp_path / "leanstream_ggml" / "mod.py").write_text(
        "def used():\n    return 1\n\n"
        "def helper(n):\n    return helper(n - 1) if n else used()\n\n"
        "def run():\n    return used()\n\n"
        "class Writer:\n    pass\n")
    (tmp_path / "converters" / "x.py").write_text("from leanstream_ggml.mod import Writer, helper\n")
    (tmp_path / "tests" / "test_x.py").write_text("from leanstream_ggml import mod\nmod.helper(2)\n")
    assert not_used_by_the_runtime(tmp_path) == {"leanstream_ggml.mod.helper": "leanstream_ggml/mod.py:4",
                                                 "leanstream_ggml.mod.Writer": "leanstream_ggml/mod.py:10"}


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
