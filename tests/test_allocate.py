"""The allocate stage's two numeric steps against plain references: the excess loss of the
sketch's candidates, and the greedy allocation against brute force."""

from __future__ import annotations

import itertools

import numpy as np

from converters import allocate


def test_excess_loss_matches_a_plain_loop():
    rng = np.random.default_rng(0)
    imp = np.abs(rng.standard_normal((7, 40))).astype(np.float32)
    score = imp + rng.standard_normal((7, 40)).astype(np.float32) * 0.5      # a noisy ranking
    n_keep, n_cands = 10, [10, 15, 25, 40]
    got = allocate.excess_loss(imp, score, n_keep, n_cands)
    want = []
    for n_cand in n_cands:
        v = []
        for t in range(len(imp)):
            e = imp[t].astype(np.float64) ** 2
            best = set(np.argsort(-e)[:n_keep])
            cand = list(np.argsort(-score[t], kind="stable")[:n_cand])
            kept = sorted(cand, key=lambda i: -e[i])[:n_keep]
            v.append((sum(e[i] for i in best) - sum(e[i] for i in kept)) / e.sum())
        want.append(np.mean(v))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    assert got[-1] == 0.0 and np.all(np.diff(got) <= 1e-12)   # every neuron a candidate: nothing lost


def test_allocation_matches_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(20):
        L, R = 4, 5
        n_cand = np.sort(rng.integers(10, 100, (L, R)), axis=1)
        n_cand[:, 0] = 10
        # decreasing loss in the candidates read, one curve not convex
        loss = np.stack([np.exp(-rng.uniform(0.01, 0.1) * (n_cand[il] - 10)) * rng.uniform(0.5, 2) for il in range(L)])
        loss[0, 1] = loss[0, 0]
        row_bytes = rng.integers(100, 300, L)
        budget = int((n_cand[:, 2] * row_bytes).sum())
        at = allocate.allocate(loss, n_cand, row_bytes, budget)
        assert (n_cand[np.arange(L), at] * row_bytes).sum() <= budget
        best = min((sum(loss[il, j] for il, j in enumerate(c)), c) for c in itertools.product(range(R), repeat=L)
                   if sum(n_cand[il, j] * row_bytes[il] for il, j in enumerate(c)) <= budget)
        got = loss[np.arange(L), at].sum()
        assert got == best[0] or np.isclose(got, best[0], rtol=1e-12), (got, best)   # the optimum
        assert got <= loss[:, 2].sum() + 1e-12                # never worse than the uniform ratio
