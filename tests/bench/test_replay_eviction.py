"""bench/replay_eviction.py's replay against a plain-Python reference and against what any cache
policy must satisfy (Belady is a lower bound; a cache that holds everything reads each part once)."""

from __future__ import annotations

import numpy as np
import pytest

import bench_modules

replay_eviction = bench_modules.load("replay_eviction")


def _trace(seed=0, n_parts=300, T=120, per=40):
    """Needs with reuse: each token keeps most of the token before's parts (like a decode)."""
    rng = np.random.default_rng(seed)
    hot = rng.choice(n_parts, 60, replace=False)
    cur = rng.choice(n_parts, per, replace=False)
    needs = []
    for _ in range(T):
        keep = cur[rng.random(cur.size) < 0.6]
        new = np.concatenate([rng.choice(hot, per // 4), rng.choice(n_parts, per)])
        cur = np.unique(np.concatenate([keep, new]))[: per + 20]
        needs.append(np.unique(cur).astype(np.int64))
    size = rng.integers(1, 5, n_parts).astype(float)
    return needs, size


def _lru_reference(needs, size, capacity, n_calib):
    cache, last, read = set(), {}, 0.0
    for t, need in enumerate(needs):
        if t >= n_calib:
            read += sum(size[p] for p in need.tolist() if p not in cache)
        for p in need.tolist():
            last[p] = t
        kept, used = set(), 0.0
        for p in sorted(cache | set(need.tolist()), key=lambda p: (-last[p], p)):
            if used + size[p] > capacity:
                break
            kept.add(p)
            used += size[p]
        cache = kept
    return read / (len(needs) - n_calib)


@pytest.mark.parametrize("seed", [0, 1])
def test_replay_matches_the_reference_and_belady_bounds_every_policy(seed):
    needs, size = _trace(seed)
    n_calib = len(needs) // 2
    biggest = max(size[n].sum() for n in needs)
    unit = np.ones_like(size)   # Belady is optimal for equal sizes
    for capacity in (0.5 * biggest, biggest, 1.5 * biggest, 3 * biggest):
        got = {p: replay_eviction.replay(needs, size, capacity, p, n_calib) for p in replay_eviction.POLICIES}
        assert got["lru"] == pytest.approx(_lru_reference(needs, size, capacity, n_calib))
        cap = capacity / size.mean()
        got = {p: replay_eviction.replay(needs, unit, cap, p, n_calib) for p in replay_eviction.POLICIES}
        for p in ("lru", "frequency", "reuse"):
            assert got["belady"] <= got[p] + 1e-9, (capacity, got)
    # a cache that holds every part: only the first reads (none in the scored half of a warm cache
    # unless a part first appears there)
    everything = size.sum()
    seen_before = set(np.concatenate(needs[:n_calib]).tolist())
    first_in_scored = set(np.concatenate(needs[n_calib:]).tolist()) - seen_before
    want = sum(size[p] for p in first_in_scored) / (len(needs) - n_calib)
    for p in replay_eviction.POLICIES:
        assert replay_eviction.replay(needs, size, everything, p, n_calib) == pytest.approx(want)


def _disk_reference(ids, offset, size, file_of, bridge, max_read):
    reads, total = 0, 0.0
    cur = None   # [file, start, end]
    for p in sorted(ids.tolist()):
        if cur is not None and file_of[p] == cur[0] and offset[p] - cur[2] <= bridge:
            cur[2] = offset[p] + size[p]
            continue
        if cur is not None:
            reads += int(np.ceil((cur[2] - cur[1]) / max_read))
            total += cur[2] - cur[1]
        cur = [file_of[p], offset[p], offset[p] + size[p]]
    if cur is not None:
        reads += int(np.ceil((cur[2] - cur[1]) / max_read))
        total += cur[2] - cur[1]
    return reads, total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_disk_reads_bridge_gaps_within_a_file(seed):
    rng = np.random.default_rng(seed)
    size = rng.integers(1, 6, 400).astype(float)
    file_of = np.repeat(np.arange(4), 100)
    offset = np.concatenate([np.concatenate([[0.0], np.cumsum(size[f * 100:(f + 1) * 100])[:-1]]) for f in range(4)])
    for density in (0.05, 0.3, 0.8):
        ids = np.flatnonzero(rng.random(400) < density)
        for bridge in (0.0, 4.0, 20.0):
            got = replay_eviction.disk_reads(ids, offset, size, file_of, bridge, max_read=16.0)
            assert got == pytest.approx(_disk_reference(ids, offset, size, file_of, bridge, 16.0))
    # every part of one file, no gaps: one span, the file's bytes
    ids = np.arange(100)
    assert replay_eviction.disk_reads(ids, offset, size, file_of, 0.0, max_read=1e9) == (1, size[:100].sum())


def test_replay_on_smollm2_reports_disk_reads(smollm2_sketch_dir, tmp_path):
    """The script end to end on the real SmolLM2: the engine's own needs, every policy within
    Belady's bound, and the disk reading at least what it misses (bridged gaps on top)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "replay.json"
    subprocess.run([sys.executable, str(bench_modules.BENCH / "replay_eviction.py"), str(smollm2_sketch_dir),
                    "--tokens", "24", "--cache-mb", "10", "30", "--out", str(out)], check=True,
                   capture_output=True, timeout=600)
    got = json.loads(out.read_text())
    assert got["needed_mb_per_token"] > 0 and len(got["rows"]) == 2
    for r in got["rows"]:
        for p in ("lru", "frequency", "reuse"):
            assert r["belady_mb_per_token"] <= r[f"{p}_mb_per_token"] + 1e-6
        for p in replay_eviction.POLICIES:
            assert r[f"{p}_disk_mb_per_token"] >= r[f"{p}_mb_per_token"] - 0.1
        assert r["dense_disk_mb_per_token"] > 0 and r["dense_reads_per_token"] > 0
