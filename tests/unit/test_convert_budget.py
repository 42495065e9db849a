"""The conversion within a memory limit (converters/budget.py, converters/stages.py; docs/design.md
§22): a model converted in a memory cgroup smaller than the model itself, resuming after a kill
in each new stage, the limit read from the cgroup, and the checks made before anything is
written (disk space, one layer's work)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

gs = pytest.importorskip("gguf_synth")
from convert_runs import ROOT, convert_in_child, digests, tiny_source_and_reference  # noqa: E402


SETTINGS = dict(progress=False, profile_tokens=96)


def _convert(src, out, kill_at=None, **kw):
    return convert_in_child(src, out, {**SETTINGS, **kw}, kill_at)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_source_and_reference(tmp_path_factory.mktemp("budget"), _convert)


def test_the_default_conversion_records_its_stages(tiny):
    from leanstream_ggml import manifest

    _, ref = tiny
    m = manifest.load(ref)
    c = m.extra["conversion"]
    assert set(c["stages"]) == {"read", "write", "activations", "order", "reorder", "sketch"}
    assert all(r["seconds"] >= 0 and r["peak_rss_bytes"] > 0 for r in c["stages"].values())
    assert c["memory_limit"] > 0 and c["memory_limit_source"]
    assert m.sketch.quality == []                 # calibration is opt-in
    assert m.draft_vocab_file() and (ref / m.draft_vocab_file()).is_file()
    # the block files are in the order the importance ranking chose (not the source's)
    from converters import blockfile

    h = blockfile.read_header(ref / m.layers[0].file)
    perm = blockfile.read_perm(ref / m.layers[0].file, h)
    assert sorted(perm.tolist()) == list(range(m.n_ff)) and not np.array_equal(perm, np.arange(m.n_ff))
    imp = np.load(ref / m.block_importance_file())
    assert np.all(np.diff(imp[0]) <= 0)           # most important first


def test_decode_rows_halve_down_to_the_least_under_a_tight_limit(tiny, monkeypatch):
    """The pass's tokens per decode: ROWS without a limit; under ever tighter limits halved down to
    MIN_ROWS, never more where less fits (each step frees captures and logits for the cache). The
    process's size is held fixed, so that only the limit moves."""
    from converters.profile_pass import MIN_ROWS, ROWS, _n_vocab, decode_rows
    from leanstream_ggml import manifest, memplan

    _, ref = tiny
    m = manifest.load(ref)
    n_vocab = _n_vocab(ref, m)
    assert decode_rows(ref, m, None, True, n_vocab) == ROWS
    now = memplan.process_bytes()
    monkeypatch.setattr(memplan, "process_bytes", lambda: now)
    coarse = [(limit, decode_rows(ref, m, limit, True, n_vocab))
              for limit in range(now, now + 400 * memplan.MiB, 2 * memplan.MiB)]
    assert coarse[0][1] == MIN_ROWS and coarse[-1][1] == ROWS
    lo = max(limit for limit, r in coarse if r == MIN_ROWS)
    hi = min(limit for limit, r in coarse if r == ROWS)
    seen = [decode_rows(ref, m, limit, True, n_vocab) for limit in range(lo, hi + 1, 4096)]
    assert seen == sorted(seen)
    assert {r for r in seen} == {ROWS >> i for i in range(ROWS.bit_length()) if ROWS >> i >= MIN_ROWS}


def test_process_bytes_does_not_count_heap_the_allocator_kept():
    """Heap freed behind a live allocation stays in VmRSS until the allocator hands it back:
    process_bytes (what a memory plan counts as held) does not count it."""
    from leanstream_ggml import memplan

    before = memplan.process_bytes()
    chunks = [bytearray(64 * 1024) for _ in range(640)]          # 40 MiB of heap (under mmap's threshold)
    for c in chunks:
        c[::4096] = b"x" * len(c[::4096])                          # touched: resident
    pin = bytearray(64 * 1024)                                    # above them: the heap cannot shrink
    held = memplan.process_bytes()
    del chunks
    after = memplan.process_bytes()
    assert held - before > 30 * memplan.MiB
    assert after - before < 10 * memplan.MiB, (before, held, after)
    del pin


@pytest.mark.parametrize("kill_at", ["write-layer:1", "reorder-layer:0", "reorder-layer:2", "sketch-layer:1"])
def test_killed_conversion_resumes_to_the_same_files(tiny, tmp_path, kill_at):
    """SIGKILL inside the write stage, while the block files are reordered in place (some in the
    new order, some still in the source's), or inside the sketch stage: the same command again
    writes the same files."""
    src, ref = tiny
    out = tmp_path / "m.lsm"
    r = _convert(src, out, kill_at)
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    assert not (out / "manifest.json").exists()
    r = _convert(src, out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert digests(out) == digests(ref)


def test_a_limit_too_small_for_one_layer_is_refused_with_the_numbers(tiny, tmp_path):
    from converters.convert_gguf import ConvertError
    from converters.stages import convert_model

    src, _ = tiny
    out = tmp_path / "m.lsm"
    with pytest.raises(ConvertError, match=r"memory limit 1 MB is too small .* one layer's work takes .* at least \d+ MB"):
        convert_model(src, out, progress=False, memory_limit="1MB", log=lambda *a: None)
    assert not out.exists() or not any(out.iterdir())


def test_not_enough_disk_is_refused_before_writing(tiny, tmp_path, monkeypatch):
    from converters import budget
    from converters.convert_gguf import ConvertError
    from converters.stages import convert_model

    src, _ = tiny
    out = tmp_path / "m.lsm"
    monkeypatch.setattr(budget, "free_disk", lambda path: 1000)
    with pytest.raises(ConvertError, match=r"not enough disk space: the conversion writes about \d+ MB"):
        convert_model(src, out, progress=False, log=lambda *a: None)
    assert not out.exists() or not any(out.iterdir())


def test_cgroup_limits_are_read_up_the_hierarchy(tmp_path):
    """v1 (memory.limit_in_bytes) and v2 (memory.max): every limit set on our cgroup or above it;
    "no limit" (v1's page-rounded 2^63 - 1, v2's "max") is none."""
    from converters.budget import cgroup_limits

    v1 = tmp_path / "memory" / "a" / "b"
    v1.mkdir(parents=True)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "memory" / "a" / "memory.limit_in_bytes").write_text("2000000000\n")
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    got = cgroup_limits("4:memory:/a/b\n3:cpu:/x\n", root=tmp_path)
    assert [n for n, _ in got] == [2_000_000_000]
    v2 = tmp_path / "c"
    v2.mkdir()
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    (v2 / "memory.max").write_text("max\n")
    (tmp_path / "memory.max").write_text("1000000000\n")
    assert [n for n, _ in cgroup_limits("0::/c\n", root=tmp_path)] == [1_000_000_000]


def _cgroup_or_skip():
    from leanstream_tools.cgroup import availability

    ok, why = availability()
    if not ok:
        pytest.skip(f"no writable memory cgroup here ({why}): the conversion under a real limit is not tested")


def test_a_model_larger_than_the_limit_converts_within_it(tmp_path):
    """A 0.9 GB model (F32 FFN) converted in a memory cgroup of 300 MB, with no --memory-limit: the
    converter reads the cgroup's limit, runs the model through the dense engine within it (the
    FFN streamed from the block files it just wrote) and finishes; every file verifies, each layer
    is a permutation of its neurons, most important first."""
    _cgroup_or_skip()
    from converters import blockfile
    from leanstream_ggml import manifest
    from leanstream_tools.cgroup import run_command

    src = tmp_path / "big.gguf"
    # (the dense engine holds one layer's blocks at least, 28 MB here)
    gs.write_tiny_model(src, arch="llama", n_layer=32, n_embd=1024, n_ff=2304, n_head=8, n_head_kv=2,
                        types={"ffn": "F32", "attn": "Q4_0", "embd": "F16", "output": "F16"}, seed=3)
    limit = 300_000_000
    assert src.stat().st_size > 3 * limit
    out = tmp_path / "big.lsm"
    cmd = [sys.executable, "-m", "leanstream_ggml.cli", "convert", str(src), str(out), "--quiet", "--profile-tokens", "128"]
    r = run_command(cmd, limit_bytes=limit, timeout_s=600, cwd=str(ROOT))
    assert r.status == "ok", (r.status, r.stderr[-6000:])
    assert f"memory limit {limit / 1e6:.0f} MB (the memory cgroup's limit" in r.stderr
    m = manifest.load(out)
    c = m.extra["conversion"]
    assert 0 <= limit - c["memory_limit"] < 4096           # (the kernel rounds the limit down to a page)
    assert set(c["stages"]) >= {"write", "activations", "order", "reorder", "sketch"}
    v = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "verify", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert v.returncode == 0, v.stdout + v.stderr
    imp = np.load(out / m.block_importance_file())
    for il in range(m.n_layer):
        path = out / m.layers[il].file
        perm = blockfile.read_perm(path, blockfile.read_header(path))
        assert sorted(perm.tolist()) == list(range(m.n_ff))
        assert np.all(np.diff(imp[il]) <= 0)


@pytest.mark.slow
def test_smollm2_converts_in_a_300MB_cgroup(smollm2_gguf, smollm2_sketch_dir, tmp_path):
    """The real model's default conversion, the whole process in a memory cgroup of 300 MB (its
    GGUF is 98 MB, the converted directory ~180 MB): status 0, every file intact, and what the
    activations pass decided is what it decides without a limit: each layer's most important 30 %
    of neurons (dense mode's resident set, the draft FFN) and the draft vocabulary. (Under the
    limit the pass decodes fewer tokens at a time, so neurons of near-equal importance can trade
    places, and with them the order of dense mode's float sums: greedy answers of the two
    directories can part at a near-tie, each matching stock llama.cpp within its rounding.)"""
    _cgroup_or_skip()
    from converters import blockfile
    from leanstream_ggml import manifest
    from leanstream_tools.cgroup import run_command

    out = tmp_path / "smol.lsm"
    limit = 300_000_000
    r = run_command([sys.executable, "-m", "leanstream_ggml.cli", "convert", str(smollm2_gguf), str(out), "--quiet"],
                    limit_bytes=limit, timeout_s=1200, cwd=str(ROOT))
    assert r.status == "ok", (r.status, r.cgroup, r.stderr[-3000:])
    m, ref = manifest.load(out), manifest.load(smollm2_sketch_dir)
    c = m.extra["conversion"]
    assert 0 <= limit - c["memory_limit"] < 4096
    assert max(s["peak_rss_bytes"] for s in c["stages"].values()) <= limit
    v = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "verify", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert v.returncode == 0, v.stdout + v.stderr
    for il in range(m.n_layer):
        perms = [blockfile.read_perm(d / mm.layers[il].file, blockfile.read_header(d / mm.layers[il].file))
                 for d, mm in ((out, m), (smollm2_sketch_dir, ref))]
        n = int(0.3 * m.n_ff)
        assert len(set(perms[0][:n]) & set(perms[1][:n])) >= 0.98 * n, il
    va, vb = np.load(out / m.draft_vocab_file()), np.load(smollm2_sketch_dir / ref.draft_vocab_file())
    assert len(set(va[:32768]) & set(vb[:32768])) >= 0.99 * 32768
