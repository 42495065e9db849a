"""Conversions in a child process (so that a test can SIGKILL one at a fault point,
leanstream_convert/_faults.py) and a model directory's files by content, for the resume tests."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_RUN = r"""
import json, sys
from leanstream_convert.stages import convert_model
convert_model(sys.argv[1], sys.argv[2], log=lambda *a: None, **json.loads(sys.argv[3]))
"""


def convert_in_child(src, out, settings: dict, kill_at: str | None = None) -> subprocess.CompletedProcess:
    """convert_model(src, out, **settings) in a child; kill_at: LEANSTREAM_TEST_KILL_AT."""
    env = dict(os.environ)
    env.pop("LEANSTREAM_TEST_KILL_AT", None)
    if kill_at:
        env["LEANSTREAM_TEST_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, "-c", _RUN, str(src), str(out), json.dumps(settings)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def digests(d: Path) -> dict:
    """sha256 of every file of a model directory, but the training log (it holds timings); the
    manifest without the conversion's stage timings."""
    out = {}
    for p in sorted(d.rglob("*")):
        if not p.is_file() or p.name == "predictor.json":
            continue
        data = p.read_bytes()
        if p.name == "manifest.json":
            m = json.loads(data)
            m.pop("conversion", None)
            data = json.dumps(m, sort_keys=True).encode()
        out[str(p.relative_to(d))] = hashlib.sha256(data).hexdigest()
    return out


def tiny_source_and_reference(d: Path, convert) -> tuple[Path, Path]:
    """A 3-layer synthetic llama GGUF in d and its conversion by ``convert(src, out)`` (a child,
    which must succeed): the reference a resumed conversion is compared with."""
    from gguf_synth import write_tiny_model

    src = d / "tiny.gguf"
    write_tiny_model(src, arch="llama", n_layer=3, n_embd=64, n_ff=96,
                     types={"ffn": "Q8_0", "attn": "F32", "embd": "F32", "output": "F32"}, seed=0)
    ref = d / "ref.lsm"
    r = convert(src, ref)
    assert r.returncode == 0, r.stderr[-3000:]
    return src, ref
