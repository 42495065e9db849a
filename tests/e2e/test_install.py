"""leanstream-ggml installed the way Python packages install (README: Install), into a fresh
virtual environment outside the checkout: the patched llama-cpp-python from the build cache
(leanstream_ggml/build.py), then the sdist and, after it is uninstalled, the wheel `pip wheel .`
builds, each non-editable with its [convert,server] extras from the registry; each converts
SmolLM2 and answers with `leanstream chat` what the checkout answers on that directory, importing
nothing from the checkout; `pip uninstall` leaves no file behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from leanstream_ggml import build

ROOT = Path(__file__).resolve().parents[2]
# what lists every file of the environment's site-packages and scripts that no installed
# distribution's RECORD names (run by the environment's python)
ORPHANS = """
import sysconfig
from importlib import metadata
from pathlib import Path
owned = {Path(d.locate_file(f)).resolve() for d in metadata.distributions() for f in (d.files or ())}
for root in {Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib", "scripts")}:
    for p in root.rglob("*"):
        if p.is_file() and "__pycache__" not in p.parts and p.resolve() not in owned:
            print(p)
"""


def _run(cmd, cwd: Path, timeout: int = 900) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh virtual environment (outside the checkout) with the cached patched llama-cpp-python."""
    d = tmp_path_factory.mktemp("install") / "venv"
    _run([sys.executable, "-m", "venv", d], cwd=d.parent)
    _run([d / "bin" / "python", "-m", "pip", "install", "-q", build.build_llama_wheel()], cwd=d.parent)
    yield d
    shutil.rmtree(d, ignore_errors=True)   # hundreds of MB


def _leftovers(venv: Path) -> set[str]:
    return set(_run([venv / "bin" / "python", "-c", ORPHANS], cwd=venv).split())


def test_sdist_and_wheel_install_convert_answer_and_uninstall(venv, smollm2_gguf, tmp_path):
    py = venv / "bin" / "python"
    dist = tmp_path / "dist"
    _run([sys.executable, "-c", "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])",
          dist], cwd=ROOT)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, ROOT], cwd=tmp_path)
    (sdist,) = dist.glob("leanstream_ggml-*.tar.gz")
    (wheel,) = dist.glob("leanstream_ggml-*.whl")
    before = _leftovers(venv)
    # the sdist with the default stages (the calibration corpus, the sketch), the wheel with the fewest;
    # both over fewer calibration positions than the default's (its activations pass: ~2 minutes here)
    rounds = [(sdist, ["--profile-tokens", "512"]), (wheel, ["--sketch", "none", "--profile-tokens", "256"])]
    for n, (package, convert_args) in enumerate(rounds):
        _run([py, "-m", "pip", "install", "-q", f"{package}[convert,server]"], cwd=tmp_path)
        where = _run([py, "-c", "import leanstream_ggml.native._native as n; print(n._LIB); "
                      "print(next(h for h in n._HEADER_CANDIDATES if h.exists()))"], cwd=tmp_path).split()
        site = venv.resolve()
        assert all(Path(p).resolve().is_relative_to(site) for p in where), where   # nothing from the checkout
        commands = _run([venv / "bin" / "leanstream", "--help"], cwd=tmp_path)
        assert all(c in commands for c in ("convert", "chat", "serve", "bench")), commands
        assert "leanstream-ggml" in _run([py, "-m", "leanstream_ggml", "--version"], cwd=tmp_path)
        model = tmp_path / f"smollm2-{n}.lsm"
        _run([venv / "bin" / "leanstream", "convert", smollm2_gguf, model, *convert_args], cwd=tmp_path)
        chat = ["chat", model, "-p", "What is the capital of France?", "--memory-budget", "64MiB", "--temp", "0",
                "-n", "24"]
        answer = _run([venv / "bin" / "leanstream", *chat], cwd=tmp_path)
        assert answer.strip() and answer == _run([sys.executable, "-m", "leanstream_ggml", *chat], cwd=ROOT)
        shutil.rmtree(model)
        _run([py, "-m", "pip", "uninstall", "-y", "-q", "leanstream-ggml"], cwd=tmp_path)
        assert _leftovers(venv) == before
        site_packages = {p.name for p in (venv / "lib").glob("python*/site-packages/*")}
        assert not [p for p in site_packages | {p.name for p in (venv / "bin").iterdir()} if "leanstream" in p]
