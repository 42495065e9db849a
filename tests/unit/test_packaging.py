"""What a wheel built from the checkout installs: every top-level name starts with "leanstream"
(each package from the folder of its name), the data
files the packages read at run time are in it, and nothing of the repository's other folders
(tests, bench, scripts) is."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> list[str]:
    pytest.importorskip("setuptools", reason="building a wheel needs setuptools in this environment")
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.rmtree(ROOT / "build", ignore_errors=True)      # setuptools' scratch folder (ignored by git)
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel).namelist()


def test_every_top_level_name_starts_with_leanstream(wheel_names):
    tops = sorted({n.split("/")[0] for n in wheel_names})
    assert tops and all(t.startswith("leanstream") for t in tops), tops
    assert {"leanstream_ggml", "leanstream_tools", "leanstream_convert"} <= set(tops)


def test_the_wheel_holds_the_data_and_no_repository_folder(wheel_names):
    names = set(wheel_names)
    for f in ("leanstream_convert/data/calibration/prose.txt", "leanstream_convert/stages.py",
              "leanstream_convert/train/pipeline.py", "leanstream_tools/data/heldout-code.txt",
              "leanstream_ggml/cli.py"):
        assert f in names, f
    assert not [n for n in names if n.split("/")[0] in ("tests", "bench", "scripts", "converters", "native")]
