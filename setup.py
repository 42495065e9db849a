"""setuptools' part of the build (the rest is pyproject.toml): every wheel carries the native library.

`pip install .`, `pip install <sdist>` and `pip wheel .` compile native/ into the wheel's
leanstream_ggml/_lib/ (libleanstream.so and the leanstream.h it was compiled from, which the
binding reads) against the patched llama-cpp-python's ggml (leanstream_ggml/build.py:
ggml_for_build, build_native), and copy patches/ there (so that an installed package can build
and install the patched llama-cpp-python itself: `python -m leanstream_ggml.build`). The wheel is
then platform-specific but not Python-specific (the binding is cffi's ABI mode): py3-none-<platform>.
An editable install (`pip install -e .`) compiles into leanstream_ggml/_lib/ of the tree, as
`python -m leanstream_ggml.build` does. Where no working CMake is on PATH (none, too old, or a
Python-script cmake that pip's isolated build environment breaks), the build asks pip for the
registry's (setup_requires: setuptools hands it to pip as a build requirement).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.errors import ExecError

ROOT = Path(__file__).resolve().parent


def _build_module():
    """leanstream_ggml/build.py by its path (standard library only: importing the package is not needed)."""
    spec = importlib.util.spec_from_file_location("_leanstream_build", ROOT / "leanstream_ggml" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cmake_works() -> bool:
    """Whether `cmake` on PATH runs here and is new enough for native/CMakeLists.txt (3.16)."""
    try:
        r = subprocess.run(["cmake", "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    m = re.search(r"version (\d+)\.(\d+)", r.stdout)
    return r.returncode == 0 and m is not None and (int(m[1]), int(m[2])) >= (3, 16)


class BuildPyWithNative(build_py):
    def run(self):
        if not self.editable_mode:   # build/lib outlives a build: a module deleted since must not ship
            for package in Path(self.build_lib).glob("leanstream_*"):
                shutil.rmtree(package)
        super().run()
        b = _build_module()
        try:
            if self.editable_mode:
                b.build_native()
                return
            out = Path(self.build_lib) / "leanstream_ggml" / "_lib"
            with tempfile.TemporaryDirectory(prefix="leanstream-native-") as tmp:
                # llama-cpp-python's libraries sit in site-packages/llama_cpp/lib, the wheel's here
                b.build_native(out, build_dir=Path(tmp), rpath="$ORIGIN/../../llama_cpp/lib")
        except b.BuildError as e:
            raise ExecError(f"leanstream-ggml: {e}") from None
        shutil.copytree(b.PATCH_DIR, out / "patches", dirs_exist_ok=True)


class NativeDistribution(Distribution):
    def has_ext_modules(self):   # a native library inside: platlib, a platform tag
        return True


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])   # any Python 3 (cffi's ABI mode), this platform


setup(distclass=NativeDistribution, cmdclass={"build_py": BuildPyWithNative, "bdist_wheel": PlatformWheel},
      setup_requires=[] if _cmake_works() else ["cmake>=3.16"])
