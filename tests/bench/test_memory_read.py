"""bench/memory_read.py: its C reader folds every byte it times (the fold checked before a time is
kept), refuses bad arguments, and the script prints one JSON object."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

import bench_modules

memory_read = bench_modules.load("memory_read")


def _scalar_fold(n_bytes: int) -> int:
    """The reader's buffer (its LCG) folded word by word, in Python integers."""
    x, want = 0x9E3779B97F4A7C15, 0
    for _ in range(n_bytes // 8):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        want ^= x
    return want


def test_memory_read_folds_every_word(tmp_path):
    exe = memory_read.build(tmp_path)
    for n, threads in ((64 * 1024, 1), (3 * 64 * 1000, 3), (64 * 7, 2)):   # shares of unequal lines too
        got = memory_read.run(exe, n, threads, rounds=3)
        assert got["bytes"] == n and got["threads"] == threads and len(got["seconds"]) == 3
        assert int(got["fold"], 16) == _scalar_fold(n)
        assert all(s > 0 for s in got["seconds"]) and got["gb_s"] > 0
    assert memory_read.run(exe, 1000, 1, 1)["bytes"] == 960   # whole 64-byte lines


def test_memory_read_refuses_bad_arguments(tmp_path):
    exe = memory_read.build(tmp_path)
    for args in (["100", "1", "1"], ["0", "1", "1"], ["4096", "0", "1"], ["4096", "65", "1"], ["4096", "1", "0"]):
        p = subprocess.run([str(exe), *args], capture_output=True, text=True)
        assert p.returncode == 2 and "BYTES must be" in p.stderr


def test_memory_read_script_prints_one_json_object(tmp_path):
    out = tmp_path / "mem.json"
    p = subprocess.run([sys.executable, str(bench_modules.BENCH / "memory_read.py"), "--bytes", str(1 << 20),
                        "--threads", "2", "--rounds", "2", "--out", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got == json.loads(out.read_text())
    assert got["bytes"] == 1 << 20 and got["threads"] == 2 and len(got["seconds"]) == 2
    assert got["gb_s"] == round((1 << 20) / float(np.median(got["seconds"])) / 1e9, 3)
