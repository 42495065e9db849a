"""The walls that keep the runtime light and its tools on top of it.

The runtime package never imports the converter or a tool, and using it (import, a Llama
decode, `leanstream chat -p`) never loads torch, scikit-learn or gguf; the check runs in a fresh
interpreter, so the test session's own imports cannot hide a breach. The runtime holds only what
it or its tools run: nothing in it serves only the converter or the tests (writers and
quantizers live in leanstream_convert/, numpy oracles in tests/support/reference.py). The tools (leanstream_tools/,
bench/*.py) use only the library's public API, as llama.cpp's tools use llama.h: no private
module or name of leanstream_ggml, no ``obj._private`` attribute of a library or llama-cpp-python
object. No module of the library is over 500 lines."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "sklearn", "gguf", "leanstream_convert")
TOOLS = ("leanstream_tools", "bench")
MAX_LINES = 500


def _imports(path: Path) -> set[str]:
    """Top-level names of every module a file imports (at any depth of its code)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_runtime_sources_never_import_the_converter_or_a_tool():
    offenders = {}
    for path in sorted((ROOT / "leanstream_ggml").rglob("*.py")):
        bad = _imports(path) & set(HEAVY + TOOLS)
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert not offenders, f"the runtime imports converter-side modules or tools: {offenders}"


def test_the_converter_imports_no_tool():
    """The converter stands beside the tools, not above them: what its calibration needs (texts as
    the model sees them, the windows perplexity scores) is the library's public API, which the
    tools use too; a change to a tool cannot change a conversion."""
    offenders = {str(p.relative_to(ROOT)): sorted(bad) for p in sorted((ROOT / "leanstream_convert").rglob("*.py"))
                 if (bad := _imports(p) & set(TOOLS))}
    assert not offenders, f"the converter imports tools: {offenders}"


def test_the_library_reads_no_test_variable_from_the_environment():
    """Test hooks are an engine's own (FFNEngine's test_hooks keyword); no library module reads a
    test's variable (LEANSTREAM_TEST_*) from the environment, nor names one."""
    found = []
    for path in sorted((ROOT / "leanstream_ggml").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "LEANSTREAM_TEST" in node.value:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert not found, f"the library names a test's environment variable: {found}"


MAX_TOP_MODULES = 12


def test_the_runtime_top_level_holds_at_most_12_modules():
    """The runtime's rooms are its subpackages (the model directory, the native engine's binding,
    llama.cpp's, speculation, the commands); its top level keeps what a user meets first."""
    tops = sorted(p.name for p in (ROOT / "leanstream_ggml").glob("*.py"))
    assert len(tops) <= MAX_TOP_MODULES, f"leanstream_ggml/ has {len(tops)} top-level modules: {tops}"


FIGURE = re.compile(r"\d[\d.,]*\s*(tok/s|tokens/s|ms\b|µs|GB/s|MB/s)|×\s?\d")


def docstring_figures(root: Path = ROOT) -> list[str]:
    """"path:line: text" of every docstring of the runtime that quotes a measured speed or time:
    figures go stale in a docstring; they live in bench/results, which a docstring may cite."""
    out = []
    for path in sorted((root / "leanstream_ggml").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False) or ""
                out += [f"{path.relative_to(root)}:{getattr(node, 'lineno', 1)}: {m.group(0)}" for m in FIGURE.finditer(doc)]
    return out


def test_no_docstring_of_the_runtime_quotes_a_measured_figure():
    bad = docstring_figures()
    assert not bad, "docstrings quoting measured figures (move them to bench/results):\n" + "\n".join(bad)


def test_the_figure_check_sees_one(tmp_path):
    (tmp_path / "leanstream_ggml").mkdir()
    (tmp_path / "leanstream_ggml" / "m.py").write_text(
        '"""Fast: 35 against 46 ms a token."""\n\n\ndef f():\n    """Reads 512MiB at most."""\n')
    assert docstring_figures(tmp_path) == ["leanstream_ggml/m.py:1: 46 ms"]


def test_no_module_of_the_library_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "leanstream_ggml").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules of leanstream_ggml/ over {MAX_LINES} lines (split them by concern): {long}"


# ---- functions a reader can hold ---------------------------------------------------------------------

MAX_PY_FUNCTION, MAX_C_FUNCTION = 80, 90


def long_functions(root: Path = ROOT) -> dict[str, int]:
    """{"path:line name": lines} of every Python function of a shipped package longer than
    MAX_PY_FUNCTION lines (its def line to its last)."""
    out = {}
    for path in sorted(p for folder in SHIPPED.values() if (root / folder).is_dir() for p in (root / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_PY_FUNCTION:
                    out[f"{path.relative_to(root)}:{node.lineno} {node.name}"] = n
    return out


def test_no_python_function_is_over_80_lines():
    long = long_functions()
    assert not long, f"functions over {MAX_PY_FUNCTION} lines (split them into named steps): {long}"


def test_the_function_length_check_sees_one(tmp_path):
    (tmp_path / "leanstream_convert").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_PY_FUNCTION))
    (tmp_path / "leanstream_convert" / "long.py").write_text("def short():\n    return 1\n\n\ndef long():\n" + body)
    assert long_functions(tmp_path) == {"leanstream_convert/long.py:5 long": MAX_PY_FUNCTION + 1}


def test_no_c_function_in_native_src_is_over_90_lines():
    lizard = pytest.importorskip("lizard", reason="C function lengths are measured with lizard (pip install lizard)")
    long = {f"{path.name}:{f.start_line} {f.name}": f.length
            for path in sorted((ROOT / "native" / "src").glob("*.[ch]"))
            for f in lizard.analyze_file(str(path)).function_list if f.length > MAX_C_FUNCTION}
    assert not long, f"C functions over {MAX_C_FUNCTION} lines (split them into named steps): {long}"


# ---- no import circle, no string import across floors, in any shipped package ----------------------

# every package a wheel installs: import name -> its folder in the repository (the same name)
SHIPPED = {"leanstream_ggml": "leanstream_ggml", "leanstream_tools": "leanstream_tools",
           "leanstream_convert": "leanstream_convert"}


def _shipped_modules(root: Path, packages: dict = SHIPPED) -> dict[str, Path]:
    """{module's import name: its file} for every module of the shipped packages under root."""
    mods = {}
    for name, folder in packages.items():
        for path in sorted((root / folder).rglob("*.py")) if (root / folder).is_dir() else ():
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([name] + parts)] = path
    return mods


def _shipped_imports(root: Path, packages: dict = SHIPPED) -> dict[str, set[str]]:
    """{module: the shipped modules it imports}, at any depth of its code (an import inside a
    function closes a circle as surely as one at the top, only later). ``from . import x``
    imports the submodule x; ``from . import name`` (not a module) the package's __init__."""
    mods = _shipped_modules(root, packages)
    graph = {}
    for module, path in mods.items():
        is_package, out = path.name == "__init__.py", set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                src = _import_source(node, module, is_package)
                out.update(f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        graph[module] = {m for m in out if m in mods and m != module}
    return graph


def import_cycles(root: Path = ROOT, packages: dict = SHIPPED) -> list[list[str]]:
    """Every import circle among the shipped packages' modules (within one package or across
    them): the strongly connected components of more than one module (Tarjan), each sorted."""
    graph = _shipped_imports(root, packages)
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_circle_in_any_shipped_package():
    cycles = import_cycles()
    assert not cycles, ("modules that import each other, directly or around a loop (one owns what the other "
                        f"asks for; move it, or pass it in): {cycles}")


@pytest.mark.parametrize("package", sorted(SHIPPED))
def test_the_circle_check_sees_one(tmp_path, package):
    """The check above is not vacuous, in any shipped package: a circle through function-level
    imports (a -> b -> c -> a) is found; the package's __init__ and a plain ``from . import
    sibling`` close none."""
    pkg = tmp_path / SHIPPED[package]
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def __getattr__(name):\n    from .a import A\n    return A\n")
    (pkg / "a.py").write_text("from . import b\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from .c import g\n    return g()\n")
    (pkg / "c.py").write_text(f"def g():\n    from {package}.a import A\n    return A\n")
    (pkg / "d.py").write_text("from . import a, __version__\n")
    assert import_cycles(tmp_path) == [[f"{package}.a", f"{package}.b", f"{package}.c"]]
    (pkg / "c.py").write_text("def g():\n    return 1\n")
    assert import_cycles(tmp_path) == []


def test_the_circle_check_sees_one_across_packages(tmp_path):
    """The runtime importing the converter that imports the runtime is a circle too."""
    for name, folder in SHIPPED.items():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "leanstream_ggml" / "x.py").write_text("def f():\n    import leanstream_convert.y\n")
    (tmp_path / "leanstream_convert" / "y.py").write_text("from leanstream_ggml import x\n")
    assert import_cycles(tmp_path) == [["leanstream_convert.y", "leanstream_ggml.x"]]


def string_imports(root: Path = ROOT, packages: dict = SHIPPED) -> list[str]:
    """"path:line: name" for every string in a shipped package that names a module of another
    shipped package (an importlib.import_module argument, a registry's module path, an entry
    point): the floors meet through imports a reader and this test can follow, or through the
    entry points pyproject.toml declares, never through a name in a string."""
    out = []
    for module, path in _shipped_modules(root, packages).items():
        own = module.split(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            name = node.value.split(":", 1)[0]
            top = name.split(".")[0]
            if top in packages and top != own and all(p.isidentifier() for p in name.split(".")):
                out.append(f"{path.relative_to(root)}:{node.lineno}: {node.value}")
    return out


def test_no_string_import_across_floors():
    bad = string_imports()
    assert not bad, "a shipped package names another's module in a string:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", sorted(SHIPPED))
def test_the_string_import_check_sees_one(tmp_path, package):
    """Not vacuous: in any shipped package, a module path of another package in a string (an
    importlib call, a registry entry) is reported; its own package's paths and prose are not."""
    for name, folder in SHIPPED.items():
        (tmp_path / folder).mkdir()
    other = next(n for n in sorted(SHIPPED) if n != package)
    (tmp_path / SHIPPED[package] / "reg.py").write_text(
        "import importlib\n"
        f"COMMANDS = {{'x': ('{package}.own', 'help')}}\n"
        f"TEXT = 'see {other}.cli for more'\n"
        f"def load():\n    return importlib.import_module('{other}.cli')\n")
    assert string_imports(tmp_path) == [f"{SHIPPED[package]}/reg.py:5: {other}.cli"]


# ---- the tools and the converter use the library's public API only --------------------------------

LIBRARIES = ("leanstream_ggml", "llama_cpp", "leanstream_convert", "leanstream_tools")  # whose private names others must not use
# the packages on top of the library, each checked against the others' private names: its own
# package name, its folders
ON_TOP = {"leanstream_tools": ("leanstream_tools", "bench"), "leanstream_convert": ("leanstream_convert",)}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _tool_files(root: Path, folders=("leanstream_tools", "bench")) -> list[Path]:
    out = []
    for folder in folders:
        if (root / folder).is_dir():
            out += sorted((root / folder).rglob("*.py")) if folder != "bench" else sorted((root / folder).glob("*.py"))
    return out


def _own_private_names(files: list[Path]) -> set[str]:
    """The private names the tools define themselves (their classes' methods and attributes,
    their modules' helpers): using those on their own objects is fine."""
    out = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                out.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                out.add(node.attr)     # self._x = ...: a tool class's own (not llm._x = ...)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
                out.add(node.id)
            elif isinstance(node, ast.arg) and _private(node.arg):
                out.add(node.arg)      # a keyword of its own function
    return out


def _private_uses_in(root: Path, own_package: str, folders) -> list[str]:
    files = _tool_files(root, folders)
    own = _own_private_names(files)
    libraries = tuple(lib for lib in LIBRARIES if lib != own_package)
    out = []
    for path in files:
        where = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            line = getattr(node, "lineno", 0)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                parts = node.module.split(".")
                if parts[0] in libraries:
                    if any(_private(p) for p in parts):
                        out.append(f"{where}:{line}: imports {node.module}")
                    out += [f"{where}:{line}: imports {node.module}.{a.name}" for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    parts = a.name.split(".")
                    if parts[0] in libraries and any(_private(p) for p in parts):
                        out.append(f"{where}:{line}: imports {a.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                out.append(f"{where}:{line}: uses .{node.attr}")
            elif isinstance(node, ast.keyword) and node.arg and _private(node.arg) and node.arg not in own:
                out.append(f"{where}:{node.value.lineno}: passes {node.arg}=")
    return out


def private_uses(root: Path = ROOT) -> list[str]:
    """"path:line: what" for every use of another package's private name by a package on top of
    the library (the tools, bench/, the converter): a private module or name imported from
    leanstream_ggml / llama_cpp / another shipped package, an ``x._name`` attribute or a
    ``_name=`` keyword that the package does not define itself (on a Llama, a llama_cpp object, a
    library module)."""
    return [u for package, folders in ON_TOP.items() for u in _private_uses_in(root, package, folders)]


def test_the_tools_and_the_converter_use_only_the_public_api():
    bad = private_uses()
    assert not bad, ("the tools or the converter reach into private names of the library, of each other or of "
                     "llama-cpp-python (add a public function or method instead):\n" + "\n".join(bad))


def test_the_tool_wall_sees_a_private_use(tmp_path):
    """The check above is not vacuous: a private module, a private name and a private attribute of
    a library object are each reported; a tool's own private helpers and attributes are not."""
    (tmp_path / "leanstream_tools").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "leanstream_tools" / "x.py").write_text(
        "from leanstream_ggml.native import _native\n"
        "from leanstream_ggml.native.params import _default, size_bytes\n"
        "import llama_cpp._internals\n"
        "class Own:\n"
        "    def __init__(self):\n        self._mine = 1\n"
        "    def _helper(self):\n        return self._mine\n"
        "def _local():\n    return Own()._helper()\n")
    (tmp_path / "bench" / "y.py").write_text("def f(llm):\n    llm._rows = 2\n"
                                             "    return llm._ctx.get_logits_ith(-1), llm.__class__\n")
    assert sorted(private_uses(tmp_path)) == [
        "bench/y.py:2: uses ._rows",
        "bench/y.py:3: uses ._ctx",
        "leanstream_tools/x.py:1: imports leanstream_ggml.native._native",
        "leanstream_tools/x.py:2: imports leanstream_ggml.native.params._default",
        "leanstream_tools/x.py:3: imports llama_cpp._internals"]


def test_the_converter_wall_sees_a_private_use(tmp_path):
    """The converter is held to the same wall: a private module of the runtime, a private keyword
    of a runtime call and a private attribute of a runtime object are reported; its own are not."""
    (tmp_path / "leanstream_convert").mkdir()
    (tmp_path / "leanstream_convert" / "p.py").write_text(
        "from leanstream_ggml.native._native import lib\n"
        "from leanstream_ggml import Llama\n"
        "def run(path, m, _rows=2):\n"
        "    llm = Llama(path, _manifest=m)\n"
        "    return llm._engine, _rows, run(path, m, _rows=1)\n")
    assert sorted(private_uses(tmp_path)) == ["leanstream_convert/p.py:1: imports leanstream_ggml.native._native",
                                              "leanstream_convert/p.py:4: passes _manifest=",
                                              "leanstream_convert/p.py:5: uses ._engine"]


# ---- the runtime holds only what it runs ---------------------------------------------------------

# Top-level functions and classes of leanstream_ggml/ that nothing in leanstream_ggml/ or its tools
# (leanstream_tools/) uses, on purpose (each with why). Everything else the runtime does not use
# belongs with its user: leanstream_convert/ (writers, quantizers, reading back what they wrote) or tests/
# (numpy oracles). bench/ scripts are no reason to keep code in the runtime: what they need of it is
# public API its tools use too, or theirs.
PUBLIC_API = {
    "leanstream_ggml.native.engine.kept_blocks": "the engine's rule for the blocks a sparsity keeps (bench/selection_analysis.py, tests)",
    "leanstream_ggml.native.engine.candidate_blocks": "the engine's rule for the candidates a ratio scores (bench/selection_analysis.py, tests)",
    "leanstream_ggml.native.engine.kernel_isa": "what the engine's kernels dispatch to here (bench/resident_speed.py reports it)",
    "leanstream_ggml.native.params.engine_params": "FFNEngine's keywords validated, for a caller that builds an engine itself (tests)",
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
    """What is called by name: the `leanstream` script and the tools' commands (pyproject.toml's
    [project.scripts] and [project.entry-points.*]), and the register() of each command module
    the CLI registry names (leanstream_ggml/cli.py COMMANDS)."""
    out = set()
    pyproject = root / "pyproject.toml"
    if pyproject.exists():   # name = "module:function" lines (tomllib is Python >= 3.11)
        text = pyproject.read_text()
        for header in ["[project.scripts]"] + [h for h in text.splitlines() if h.startswith("[project.entry-points.")]:
            section = text.split(header, 1)[1:]
            for line in section[0].split("\n[", 1)[0].splitlines() if section else ():
                if "=" in line and ":" in line and not line.lstrip().startswith("#"):
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
    that nothing in leanstream_ggml/ or leanstream_tools/ uses (dunders aside: protocol methods)."""
    pkg = root / "leanstream_ggml"
    defs = {}
    for path in sorted(pkg.rglob("*.py")):
        module = _module_name(path, root)
        for n in ast.parse(path.read_text(), str(path)).body:
            if _is_def(n) and not (n.name.startswith("__") and n.name.endswith("__")):
                defs[(module, n.name)] = f"{path.relative_to(root)}:{n.lineno}"
    used = _entry_points(root)
    for folder in (pkg, root / "leanstream_tools"):
        for path in sorted(folder.rglob("*.py")) if folder.is_dir() else ():
            used |= _uses(path, root)
    return {f"{m}.{n}": where for (m, n), where in sorted(defs.items()) if (m, n) not in used}


def test_the_runtime_holds_only_what_it_runs():
    unused = not_used_by_the_runtime()
    extra = {name: where for name, where in unused.items() if name not in PUBLIC_API}
    assert not extra, (
        "defined in the runtime but used only by the converter or the tests (or by nothing): "
        + ", ".join(f"{name} ({where})" for name, where in extra.items())
        + ". Writers and quantizers belong in leanstream_convert/, numpy oracles in tests/support/reference.py; "
          "public API goes on PUBLIC_API in tests/unit/test_walls.py, with why")
    stale = sorted(set(PUBLIC_API) - set(unused))
    assert not stale, f"PUBLIC_API lists names the runtime now uses, or that no longer exist: {stale}; remove them"


def test_the_runtime_wall_sees_a_converter_only_helper(tmp_path):
    """The check above is not vacuous: a helper the runtime defines and only the converter and the
    tests use is reported; one the runtime uses is not, nor a function of the runtime's own."""
    (tmp_path / "leanstream_ggml").mkdir()
    (tmp_path / "leanstream_convert").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "leanstream_ggml" / "__init__.py").write_text("from .mod import run\n")
    (tmp_path / "leanstream_ggml" / "mod.py").write_text(
        "def used():\n    return 1\n\n"
        "def helper(n):\n    return helper(n - 1) if n else used()\n\n"
        "def run():\n    return used()\n\n"
        "class Writer:\n    pass\n")
    (tmp_path / "leanstream_convert" / "x.py").write_text("from leanstream_ggml.mod import Writer, helper\n")
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
