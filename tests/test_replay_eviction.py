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
