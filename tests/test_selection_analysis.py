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
