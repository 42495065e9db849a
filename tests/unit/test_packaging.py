"""What a wheel built from the checkout installs: every top-level name starts with "leanstream"
(each package from the folder of its name), the data files the packages read at run time are in
it, and so are the native library, the header it was compiled from and the llama.cpp patches
(setup.py), with a platform tag; nothing of the repository's other folders (tests, bench,
scripts) is. Where the native build finds the patched llama.cpp's ggml, and what it says when it
finds none (leanstream_ggml/build.py: ggml_for_build), and the refusal of a stock llama-cpp-python
at import. tests/e2e/test_install.py installs the sdist and a wheel into a fresh environment."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from leanstream_ggml import build

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", reason="building a wheel needs setuptools in this environment")
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel_names(built_wheel) -> list[str]:
    return zipfile.ZipFile(built_wheel).namelist()


def test_every_top_level_name_starts_with_leanstream(wheel_names):
    tops = sorted({n.split("/")[0] for n in wheel_names})
    assert tops and all(t.startswith("leanstream") for t in tops), tops
    assert {"leanstream_ggml", "leanstream_tools", "leanstream_convert"} <= set(tops)


def test_the_wheel_holds_the_data_and_no_repository_folder(wheel_names):
    names = set(wheel_names)
    for f in ("leanstream_convert/data/calibration/prose.txt", "leanstream_convert/stages.py",
              "leanstream_convert/train/pipeline.py", "leanstream_tools/data/heldout-code.txt",
              "leanstream_ggml/cli.py", "leanstream_ggml/__main__.py"):
        assert f in names, f
    assert not [n for n in names if n.split("/")[0] in ("tests", "bench", "scripts", "converters", "native")]


def test_the_wheel_carries_the_native_library_its_header_and_the_patches(built_wheel, wheel_names):
    names = set(wheel_names)
    assert {"leanstream_ggml/_lib/libleanstream.so", "leanstream_ggml/_lib/leanstream.h"} <= names
    with zipfile.ZipFile(built_wheel) as zf:
        assert zf.read("leanstream_ggml/_lib/leanstream.h") == (ROOT / "native/include/leanstream.h").read_bytes()
    patches = {f"leanstream_ggml/_lib/patches/{p.relative_to(ROOT / 'patches')}" for p in build.patch_files()
               + build.package_patch_files()}
    assert patches and patches <= names
    machine = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert built_wheel.name.endswith(f"-py3-none-{machine}.whl"), built_wheel.name   # any Python 3, this platform


# ---- where the native build finds ggml ------------------------------------------------------------

def _site(root: Path, patched: bool) -> Path:
    """A site-packages with llama-cpp-python's layout: include/llama.h beside llama_cpp/lib."""
    (root / "include").mkdir(parents=True)
    (root / "include" / "llama.h").write_text("void llama_set_ffn_builder(void);\n" if patched else "int x;\n")
    (root / "llama_cpp" / "lib").mkdir(parents=True)
    (root / "llama_cpp" / "lib" / "libggml-base.so").write_bytes(b"")
    return root


@pytest.fixture
def in_site(monkeypatch, tmp_path):
    """ggml_for_build looking at tmp_path/site as this interpreter's site-packages, with an empty cache."""
    monkeypatch.setenv("LEANSTREAM_CACHE", str(tmp_path / "cache"))
    site = tmp_path / "site"
    monkeypatch.setattr(build.sysconfig, "get_paths", lambda: {"purelib": str(site), "platlib": str(site)})
    return site


def test_the_patched_llama_cpp_python_installed_here_is_the_one_compiled_against(in_site):
    _site(in_site, patched=True)
    assert build.ggml_for_build() == (in_site / "include", in_site / "llama_cpp" / "lib")


def test_a_stock_llama_cpp_python_falls_back_to_the_cached_build(in_site):
    _site(in_site, patched=False)
    cached = build.llama_build_dir()
    _site(cached, patched=True)
    with zipfile.ZipFile(cached / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl", "w") as zf:
        for name in ("libggml-base.so", "libggml-base.so.0", "libggml.so", "libggml.so.0", "libllama.so"):
            zf.writestr(f"llama_cpp/lib/{name}", name)
    inc, lib = build.ggml_for_build()
    assert inc == cached / "include"
    assert sorted(p.name for p in lib.iterdir()) == ["libggml-base.so", "libggml-base.so.0", "libggml.so", "libggml.so.0"]


def test_no_patched_build_anywhere_names_the_fix(in_site):
    _site(in_site, patched=False)
    with pytest.raises(build.BuildError) as e:
        build.ggml_for_build()
    assert "not the patched build" in str(e.value) and "python -m leanstream_ggml.build" in str(e.value)


# ---- a stock llama-cpp-python at import ------------------------------------------------------------

def test_a_stock_llama_cpp_python_is_refused_at_import_naming_the_fix(tmp_path):
    """A llama_cpp whose libllama lacks the patch's llama_set_ffn_builder (here: a stand-in package
    whose library is libc) stops the binding's import with the command that installs the patched one."""
    pkg = tmp_path / "llama_cpp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import llama_cpp\n__version__ = '0.3.36'\n")
    (pkg / "llama_cpp.py").write_text("import ctypes\n_lib = ctypes.CDLL(None)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    r = subprocess.run([sys.executable, "-c", "import leanstream_ggml.native._native"], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and "not the patched build" in last, r.stderr[-2000:]
    assert "python -m leanstream_ggml.build" in last and str(pkg) in last
