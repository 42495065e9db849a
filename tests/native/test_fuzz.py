"""Seeded fuzz loop: random corruption of each file of a model directory (tests/support/fuzz_worker.py,
run as a child process so that a crash or a hang is caught and named). Every case must end in a
clean error or in output identical, bit for bit, to the uncorrupted directory's; never a crash,
a hang or a silently different answer."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

from hostile_model import HAVE_TORCH, make_model_dir

N_CASES = 400
SEED = 20261130
WORKER = Path(__file__).resolve().parents[1] / "support" / "fuzz_worker.py"


def test_fuzz_model_directory(tmp_path):
    pristine = make_model_dir(tmp_path / "src")
    work = tmp_path / "work"
    work.mkdir()
    try:
        r = subprocess.run([sys.executable, str(WORKER), str(pristine), str(work), str(N_CASES), str(SEED)],
                           capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as e:
        lines = (e.stdout or b"").decode(errors="replace").strip().splitlines() if isinstance(e.stdout, bytes) \
            else (e.stdout or "").strip().splitlines()
        raise AssertionError(f"fuzz loop hung; last event: {lines[-1] if lines else None}") from None
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    started = [e for e in events if "start" in e]
    cases = [e for e in events if "case" in e]
    assert r.returncode == 0, (f"fuzz worker died (rc {r.returncode}) during {started[-1] if started else None}:\n"
                               f"{r.stderr[-3000:]}")
    assert events[-1] == {"done": N_CASES} and len(cases) == N_CASES
    bad = [(c["file"], c["corruption"], res) for c in cases for res in c["results"]
           if res["outcome"] not in ("error", "identical")]
    assert not bad, f"{len(bad)} case(s) neither failed cleanly nor matched the pristine output: {bad[:5]}"
    files = events[0]["files"]
    assert {c["file"] for c in cases} == set(files), "every file of the model directory is fuzzed"
    if HAVE_TORCH:
        assert any(f.startswith("predictor/") for f in files) and len(events[0]["configs"]) == 2
    counts = collections.Counter((c["file"], res["outcome"]) for c in cases for res in c["results"])
    print(f"fuzz: {N_CASES} cases x {len(events[0]['configs'])} configurations over {len(files)} files: "
          + ", ".join(f"{f} {o} {n}" for (f, o), n in sorted(counts.items())))
