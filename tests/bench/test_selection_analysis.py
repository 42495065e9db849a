"""bench/selection_analysis.py's selection and error, against plain loops."""

from __future__ import annotations

import numpy as np

import bench_modules

sa = bench_modules.load("selection_analysis")


def test_cascade_keep_is_the_best_of_the_sketchs_candidates():
    rng = np.random.default_rng(0)
    sk, imp = rng.standard_normal((20, 300)), np.abs(rng.standard_normal((20, 300)))
    for n_cand, n_keep in ((120, 80), (300, 80), (80, 80)):
        got = sa.cascade_keep(sk, imp, n_cand, n_keep)
        want = np.zeros_like(got)
        for t in range(len(sk)):
            c = np.argsort(-sk[t])[:n_cand]
            want[t, c[np.argsort(-imp[t, c])[:n_keep]]] = True
        np.testing.assert_array_equal(got, want)
    # every neuron a candidate: the best keep set itself
    np.testing.assert_array_equal(sa.cascade_keep(sk, imp, 300, 80), sa.topk_mask(imp, 80))


def test_rel_error_is_the_dropped_part_of_the_output():
    rng = np.random.default_rng(1)
    a, down = rng.standard_normal((5, 40)), rng.standard_normal((40, 16))
    keep = rng.random((5, 40)) < 0.6
    got = sa.rel_error(a, down, keep)
    for t in range(5):
        y = sum(a[t, i] * down[i] for i in range(40))
        y_drop = sum(a[t, i] * down[i] for i in range(40) if not keep[t, i])
        assert np.isclose(got[t], (y_drop ** 2).sum() / (y ** 2).sum())
    assert np.allclose(sa.rel_error(a, down, np.ones_like(keep)), 0.0)


def test_ahead_recall_against_plain_sets():
    rng = np.random.default_rng(2)
    T, n, n_cand = 12, 200, 90
    sk, sk_ahead = rng.standard_normal((T, n)), rng.standard_normal((T, n))
    keep = sa.cascade_keep(sk, np.abs(rng.standard_normal((T, n))), n_cand, 50)
    got = sa.ahead_recall(sk_ahead, sk, keep, n_cand)
    spec = [set(np.argsort(-sk_ahead[t])[:n_cand]) for t in range(T)]
    cand = [set(np.argsort(-sk[t])[:n_cand]) for t in range(T)]
    kept = [set(np.flatnonzero(keep[t])) for t in range(T)]
    assert np.isclose(got["ahead_recall_cand"], sum(len(spec[t] & cand[t]) for t in range(T)) / (T * n_cand))
    assert np.isclose(got["ahead_recall_keep"], sum(len(spec[t] & kept[t]) for t in range(T)) / (T * 50))
    assert np.isclose(got["prev_token_recall_cand"],
                      sum(len(cand[t - 1] & cand[t]) for t in range(1, T)) / ((T - 1) * n_cand))
    assert got["random_recall"] == n_cand / n
    # the layer's own scores as the speculation: everything recalled
    same = sa.ahead_recall(sk, sk, keep, n_cand)
    assert same["ahead_recall_cand"] == 1.0 and same["ahead_recall_keep"] == 1.0
