"""Build the two native pieces LeanStream needs, caching them outside the checkout.

1. llama-cpp-python (pinned sdist) with `patches/` applied to its vendored llama.cpp and
   `patches/llama-cpp-python/` to the package itself, built as a wheel whose CPU backend is
   one module per instruction set (``GGML_BACKEND_DL`` + the variants in ``CPU_VARIANTS``):
   libggml loads the best one for the CPU it runs on, so one cached wheel runs AVX2 hosts
   and AVX-512 hosts at full speed. ggml's AMX variant (sapphirerapids) is left out: its
   path segfaults on the EPYC CPUs we target. No multimodal library. The wheel is cached under
   ``$LEANSTREAM_CACHE/llama-cpp-python/<version>-<key>/`` where ``key`` hashes the sdist
   version, the patch files and the CMake flags, so a second setup (or CI run) only installs it
   (with its dependencies) into this interpreter's environment.
2. ``native/`` -> ``libleanstream.so``, compiled against the ggml of a patched llama-cpp-python
   (``ggml_for_build``), and beside it ``leanstream.h``, the header it was compiled from.
   ``pip install`` / ``pip wheel`` compile it into the wheel's ``leanstream_ggml/_lib/``
   (setup.py); in a source tree this script compiles it into ``leanstream_ggml/_lib/`` in place
   (the editable install).

Runs with the standard library only (it has to work before the package is installed):
``python -m leanstream_ggml.build`` in a source tree (a checkout, or the sdist unpacked) does both;
in an installed package, only the first (its wheel carries the patches).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
REPO = Path(__file__).resolve().parent.parent
NATIVE_DIR = REPO / "native"
LIB_DIR = Path(__file__).resolve().parent / "_lib"   # libleanstream.so, leanstream.h (and an installed package's patches)
# a source tree has native/ and patches/ beside the package; an installed one, the patches its wheel
# copied into _lib/patches (setup.py), so that it too can build and install the patched llama.cpp
SOURCE_TREE = (NATIVE_DIR / "CMakeLists.txt").exists()
PATCH_DIR = (REPO if SOURCE_TREE else LIB_DIR) / "patches"   # applied in vendor/llama.cpp
PACKAGE_PATCH_DIR = PATCH_DIR / "llama-cpp-python"           # applied in the sdist's root

# ggml's CPU variants that are built, by machine (ggml/src/CMakeLists.txt names their features).
# x86-64: the project's own kernels dispatch on AVX2/AVX-512 at run time; ggml's are chosen by
# variant: nothing older than haswell; cannonlake and cooperlake are rare steps between these and
# left out. aarch64 (Linux): the plain ARMv8.0 NEON baseline (Cortex-A53/A72: Raspberry Pi 3/4),
# the dot product (Cortex-A55/A76: Pi 5, RK3588, Jetson Orin), + fp16 arithmetic, + int8 matmul
# (Graviton 3/4, Neoverse V1/N2); SVE/SME variants left out.
VARIANTS_OF_MACHINE = {
    "x86_64": ["haswell", "skylakex", "cascadelake", "icelake", "zen4", "alderlake"],
    "aarch64": ["armv8.0_1", "armv8.2_1", "armv8.2_2", "armv8.6_1"],
}


def _machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def cmake_flags(machine: str) -> list[str]:
    """llama.cpp's CMake flags for a machine. GGML_NATIVE=OFF keeps -march=native (and with it
    AMX) out of every module."""
    variants = VARIANTS_OF_MACHINE.get(machine)
    flags = ["-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON",
             "-DGGML_CPU_VARIANTS=" + ";".join(variants)] if variants else ["-DGGML_NATIVE=OFF"]
    return flags + ["-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]


CPU_VARIANTS = VARIANTS_OF_MACHINE.get(_machine(), [])   # this machine's
CMAKE_FLAGS = cmake_flags(_machine())


class BuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("LEANSTREAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "leanstream-ggml")
    return Path(base)


def _require_tools(tools: tuple[str, ...] = ("cmake", "cc", "c++", "patch")) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise BuildError(
            "missing build tools: " + ", ".join(missing)
            + " (install a C/C++ compiler, cmake and patch, e.g. `apt-get install build-essential cmake patch`"
            + " or `pip install cmake`)")


def patch_files() -> list[Path]:
    """The patches to vendor/llama.cpp."""
    return sorted(PATCH_DIR.glob("*.patch"))


def package_patch_files() -> list[Path]:
    """The patches to llama-cpp-python's own files."""
    return sorted(PACKAGE_PATCH_DIR.glob("*.patch"))


def build_key(flags: list[str] | None = None) -> str:
    """The cache key of a llama.cpp build: the version, the patches, the CMake flags (this
    machine's unless given)."""
    h = hashlib.sha256()
    h.update(LLAMA_CPP_PYTHON_VERSION.encode())
    for p in patch_files() + package_patch_files():
        h.update(p.parent.name.encode() + b"/" + p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(CMAKE_FLAGS if flags is None else flags).encode())
    return h.hexdigest()[:16]


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, **kw)
    if r.returncode != 0:
        raise BuildError(f"command failed ({r.returncode}): {' '.join(cmd)}")


def _sdist(cache: Path) -> Path:
    """The pinned llama-cpp-python sdist, downloaded once from the package registry."""
    d = cache / "sdist"
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not (d / name).exists():
        d.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(d)])
    return d / name


def _patched_source(tmp: Path) -> Path:
    """The pinned sdist extracted in tmp with every patch applied; returns its root."""
    with tarfile.open(_sdist(cache_dir())) as tf:
        tf.extractall(tmp, filter="data")
    src = tmp / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    for p in patch_files():
        _run(["patch", "-p1", "--forward", "-i", str(p)], cwd=src / "vendor" / "llama.cpp")
    for p in package_patch_files():
        _run(["patch", "-p1", "--forward", "-i", str(p)], cwd=src)
    return src


def llama_build_dir() -> Path:
    return cache_dir() / "llama-cpp-python" / f"{LLAMA_CPP_PYTHON_VERSION}-{build_key()}"


def build_llama_wheel(force: bool = False) -> Path:
    """Patched wheel in the cache (built if absent). Also leaves the patched headers there."""
    out = llama_build_dir()
    wheels = sorted(out.glob("*.whl"))
    if wheels and (out / "include" / "llama.h").exists() and not force:
        return wheels[0]
    _require_tools()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="leanstream-llama-") as tmp:
        src = _patched_source(Path(tmp))
        vendor = src / "vendor" / "llama.cpp"
        env = dict(os.environ)
        env["CMAKE_ARGS"] = " ".join(CMAKE_FLAGS)
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        for w in out.glob("*.whl"):
            w.unlink()
        # (pip's isolated build environment brings its build requirement, scikit-build-core)
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(src)], env=env)
        inc = out / "include"
        if inc.exists():
            shutil.rmtree(inc)
        inc.mkdir()
        for h in (vendor / "ggml" / "include").glob("*.h"):
            shutil.copy2(h, inc / h.name)
        shutil.copy2(vendor / "include" / "llama.h", inc / "llama.h")
    wheels = sorted(out.glob("*.whl"))
    if not wheels:
        raise BuildError(f"pip wheel produced no wheel in {out}")
    return wheels[0]


def installed_llama_lib_dir() -> Path | None:
    site = Path(sysconfig.get_paths()["purelib"])
    d = site / "llama_cpp" / "lib"
    return d if (d / "libllama.so").exists() else None


def install_llama(force: bool = False) -> Path:
    """Install the patched wheel into this interpreter's environment unless this exact build is
    there (in place of any other llama-cpp-python), with its dependencies."""
    wheel = build_llama_wheel(force=force)
    key = build_key()
    lib = installed_llama_lib_dir()
    stamp = lib / "LEANSTREAM_BUILD_KEY" if lib else None
    if force or not (stamp and stamp.exists() and stamp.read_text().strip() == key):
        _run([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(wheel)])
        _run([sys.executable, "-m", "pip", "install", str(wheel)])   # its dependencies (numpy, jinja2, ...)
        lib = installed_llama_lib_dir()
        if lib is None:
            raise BuildError("llama_cpp/lib/libllama.so not found after installing the wheel")
        (lib / "LEANSTREAM_BUILD_KEY").write_text(key + "\n")
    return lib


def _is_patched(llama_h: Path) -> bool:
    return llama_h.exists() and "llama_set_ffn_builder" in llama_h.read_text(errors="replace")


def _unpacked_libs(wheel: Path, dest: Path) -> Path:
    """libggml-base and libggml (what native/ links against) from a llama-cpp-python wheel, in dest."""
    if (dest / "libggml-base.so").exists():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        for m in zf.namelist():
            name = m.rsplit("/", 1)[-1]
            if m.startswith("llama_cpp/lib/") and name.startswith(("libggml-base.so", "libggml.so")):
                (tmp / name).write_bytes(zf.read(m))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)        # whole or absent
    return dest


def ggml_for_build() -> tuple[Path, Path]:
    """(the ggml and llama headers, the folder of libggml-base.so and libggml.so) native/ compiles and
    links against: the patched llama-cpp-python installed in this interpreter's environment (its wheel
    puts include/ beside llama_cpp/; pip's isolated build runs the interpreter it installs for, so
    that is the environment the package goes into), else the cached build of this tree's patches (its
    headers; the libraries unpacked from its wheel). BuildError naming the fix when neither is there."""
    found = []
    for site in dict.fromkeys(Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")):
        inc, lib = site / "include", site / "llama_cpp" / "lib"
        if (lib / "libggml-base.so").exists():
            if _is_patched(inc / "llama.h"):
                return inc, lib
            found.append(f"the llama-cpp-python in {site} is not the patched build (its include/llama.h "
                         "has no llama_set_ffn_builder)")
    cached = llama_build_dir()
    wheels = sorted(cached.glob("*.whl"))
    if wheels and _is_patched(cached / "include" / "llama.h"):
        return cached / "include", _unpacked_libs(wheels[0], cached / "lib")
    raise BuildError(
        "; ".join(found or [f"no llama-cpp-python is installed in {sysconfig.get_paths()['purelib']}"])
        + f", and {cached} holds no patched build: libleanstream compiles against the patched "
        "llama-cpp-python's ggml. Install that first: `python -m leanstream_ggml.build` in the source tree "
        f"(a checkout, or this sdist unpacked; builds llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} with "
        "patches/ once, ~8 minutes on 2 cores, cached, and installs it here), then install leanstream-ggml again")


def build_native(out: Path = LIB_DIR, build_dir: Path | None = None, rpath: str | None = None) -> Path:
    """Compile native/ against ggml_for_build()'s ggml; libleanstream.so and the leanstream.h it was
    compiled from go to out (default leanstream_ggml/_lib/ of this tree). build_dir: CMake's (default
    build/native-<key> of this tree, kept between builds); rpath: where the library looks for ggml
    at run time (default the folder it was linked against; a wheel: beside it in site-packages)."""
    _require_tools(("cmake", "cc"))
    inc, lib = ggml_for_build()
    bdir = build_dir or REPO / "build" / f"native-{build_key()}"  # per tree (CMake caches its source dir)
    bdir.mkdir(parents=True, exist_ok=True)
    _run(["cmake", "-S", str(NATIVE_DIR), "-B", str(bdir), "-DCMAKE_BUILD_TYPE=Release",
          f"-DLEANSTREAM_GGML_INCLUDE={inc}", f"-DLEANSTREAM_GGML_LIBDIR={lib}",
          f"-DLEANSTREAM_RPATH={rpath or lib}"], stdout=subprocess.DEVNULL)
    _run(["cmake", "--build", str(bdir), "-j", str(os.cpu_count() or 2)])
    out.mkdir(parents=True, exist_ok=True)
    for src in (bdir / "libleanstream.so", NATIVE_DIR / "include" / "leanstream.h"):
        tmp = out / (src.name + ".tmp")
        shutil.copy2(src, tmp)
        os.replace(tmp, out / src.name)  # atomic: a running process keeps its mapped copy
    return out / "libleanstream.so"


# ---- cross builds: the native library and its C tests for another Linux target ---------------------
#
# Nothing here runs on the target: the C tests run under qemu-user (tests/native/test_cross.py).
# libllama and ggml are cross-built from the same patched source (no Python package: the C tests
# drive them), cached like the wheel under $LEANSTREAM_CACHE/ggml-cross/<version>-<key>-<target>/.

CROSS_TARGETS = {
    # target: (GNU triple, CMAKE_SYSTEM_PROCESSOR); llama.cpp gets the flags a build on that
    # machine gets (cmake_flags: its CPU variants, one of which ggml loads at run time)
    "aarch64": ("aarch64-linux-gnu", "aarch64"),
}


def cross_tools(target: str) -> dict[str, str]:
    """The cross compilers and the qemu-user binary of a target, or BuildError naming the packages."""
    triple, proc = CROSS_TARGETS[target]
    tools = {"cc": f"{triple}-gcc", "cxx": f"{triple}-g++", "qemu": f"qemu-{proc}"}
    missing = [t for t in tools.values() if shutil.which(t) is None]
    if missing:
        raise BuildError(f"missing cross tools for {target}: {', '.join(missing)} (Debian: apt-get install "
                         f"gcc-{triple} g++-{triple} qemu-user)")
    return {**tools, "sysroot": f"/usr/{triple}"}


def _cross_cmake(target: str) -> list[str]:
    triple, proc = CROSS_TARGETS[target]
    return ["-DCMAKE_SYSTEM_NAME=Linux", f"-DCMAKE_SYSTEM_PROCESSOR={proc}",
            f"-DCMAKE_C_COMPILER={triple}-gcc", f"-DCMAKE_CXX_COMPILER={triple}-g++",
            f"-DCMAKE_FIND_ROOT_PATH=/usr/{triple}", "-DCMAKE_FIND_ROOT_PATH_MODE_PROGRAM=NEVER"]


def cross_ggml_dir(target: str) -> Path:
    return cache_dir() / "ggml-cross" / f"{LLAMA_CPP_PYTHON_VERSION}-{build_key(cmake_flags(target))}-{target}"


def build_cross_ggml(target: str) -> Path:
    """libllama and ggml (base, CPU backend) for the target, in cross_ggml_dir/lib (built if absent)."""
    cross_tools(target)
    out = cross_ggml_dir(target)
    if (out / "lib" / "libllama.so").exists():
        return out
    with tempfile.TemporaryDirectory(prefix="leanstream-ggml-cross-") as tmp:
        src = _patched_source(Path(tmp)) / "vendor" / "llama.cpp"
        b = Path(tmp) / "build"
        # configured from llama.cpp's root (the sdist's ggml/ cannot stand alone)
        _run(["cmake", "-S", str(src), "-B", str(b), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
              "-DLLAMA_CURL=OFF", *cmake_flags(target), *_cross_cmake(target)], stdout=subprocess.DEVNULL)
        _run(["cmake", "--build", str(b), "-j", str(os.cpu_count() or 2), "--target", "llama",
              *[f"ggml-cpu-{v}" for v in VARIANTS_OF_MACHINE.get(target, [])]])
        tmp_out = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp_out, ignore_errors=True)
        (tmp_out / "lib").mkdir(parents=True)
        for so in [*b.rglob("libggml*.so*"), *b.rglob("libllama*.so*")]:
            shutil.copy2(so, tmp_out / "lib" / so.name, follow_symlinks=False)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp_out, out)      # whole or absent: an interrupted build is redone
    return out


def cross_native_dir(target: str) -> Path:
    return REPO / "build" / f"native-{target}-{build_key(cmake_flags(target))}"


def build_cross_native(target: str) -> Path:
    """libleanstream.so and the C test programs (native/tests/*.c) for the target, in
    build/native-<target>-<key>/ of this checkout; returns that directory."""
    tools = cross_tools(target)
    ggml = build_cross_ggml(target)
    bdir = cross_native_dir(target)
    bdir.mkdir(parents=True, exist_ok=True)
    _run(["cmake", "-S", str(NATIVE_DIR), "-B", str(bdir), "-DCMAKE_BUILD_TYPE=Release",
          f"-DLEANSTREAM_GGML_INCLUDE={llama_build_dir() / 'include'}", f"-DLEANSTREAM_GGML_LIBDIR={ggml / 'lib'}",
          *_cross_cmake(target)], stdout=subprocess.DEVNULL)
    _run(["cmake", "--build", str(bdir), "-j", str(os.cpu_count() or 2)])
    for c in sorted((NATIVE_DIR / "tests").glob("*.c")):
        _run([tools["cc"], "-O2", "-Wall", "-Wextra", "-I", str(NATIVE_DIR / "include"), "-I", str(llama_build_dir() / "include"),
              str(c), "-o", str(bdir / c.stem), f"-L{bdir}", f"-L{ggml / 'lib'}", "-lleanstream", "-lllama",
              f"-Wl,-rpath,{bdir}:{ggml / 'lib'}", "-lm"])
    return bdir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m leanstream_ggml.build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="rebuild the patched llama.cpp wheel")
    ap.add_argument("--print-key", action="store_true", help="print the build cache key and exit")
    ap.add_argument("--cross", choices=sorted(CROSS_TARGETS),
                    help="build the native library and its C tests for this target instead (run under qemu-user)")
    args = ap.parse_args(argv)
    if args.print_key:
        print(build_key())
        return 0
    if args.cross:
        try:
            out = build_cross_native(args.cross)
        except BuildError as e:
            print(f"leanstream build: error: {e}", file=sys.stderr)
            return 1
        print(f"leanstream build: {args.cross} native library and C tests in {out}")
        return 0
    try:
        lib = install_llama(force=args.force)
        out = build_native() if SOURCE_TREE else None   # (an installed package's came in its wheel)
    except BuildError as e:
        print(f"leanstream build: error: {e}", file=sys.stderr)
        return 1
    print(f"leanstream build: llama.cpp at {lib}" + (f", native library {out}" if out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
