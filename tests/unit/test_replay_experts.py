"""bench/replay_experts.py: the expert cache policies on hand-worked traces, and their invariants."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import replay_experts as rx  # noqa: E402


def _seq(*xs):
    """A one-layer, one-expert-per-token trace: [1, T, 1]."""
    return np.array(xs, np.int32)[None, :, None]


def _stream(sel, E=None):
    return rx.expert_stream(sel, E)


def _policies(coef=(0.0, 0.0, 1.0, 0.0), n_layer=1, hot=()):
    return {"lru": lambda i, s, c, **kw: rx.lru(i, s, c, **kw),
            "pinned+lru": lambda i, s, c, **kw: rx.lru(i, s, c, hot=hot, **kw),
            "lfu": rx.lfu, "belady": rx.belady,
            "learned": lambda i, s, c, **kw: rx.learned(i, s, c, coef, n_layer, **kw),
            "learned+revise": lambda i, s, c, **kw: rx.learned(i, s, c, coef, n_layer, revise=True, **kw)}


def test_the_stream_goes_token_by_token_layer_by_layer_without_repeats():
    sel = np.array([[[1, 2], [3, 3]], [[0, 1], [1, -1]]])       # [L=2, T=2, k=2]
    ids, starts = _stream(sel, 4)
    assert ids.tolist() == [1, 2, 4, 5, 3, 5]                    # t0: L0 {1,2}, L1 {0,1}; t1: L0 {3}, L1 {1}
    assert starts.tolist() == [0, 2, 4, 5, 6]
    assert rx.next_use(ids, starts).tolist() == [rx.NEVER, rx.NEVER, rx.NEVER, 3, rx.NEVER, rx.NEVER]


def test_lru_and_belady_differ_where_the_cycle_outruns_the_cache():
    ids, starts = _stream(_seq(0, 1, 2, 0, 1, 2))                # 3 experts cycling through 2 slots
    assert rx.lru(ids, starts, 2).tolist() == [False] * 6        # LRU evicts each just before its reuse
    # Belady: 2 evicts 1 (needed at 4, after 0 at 3): 0 hits; 1 evicts 0 (never again): 2 hits
    assert rx.belady(ids, starts, 2).tolist() == [False, False, False, True, False, True]


def test_lfu_keeps_the_frequent_one_lru_the_recent_one():
    ids, starts = _stream(_seq(0, 0, 1, 2, 0))
    assert rx.lru(ids, starts, 2).tolist() == [False, True, False, False, False]   # 2 evicts 0 (least recent)
    assert rx.lfu(ids, starts, 2).tolist() == [False, True, False, False, True]    # 2 evicts 1 (count 1 < 2)
    # 0 pinned (hot): 2 evicts 1, the only unpinned one
    assert rx.lru(ids, starts, 2, hot=[0]).tolist() == [False, True, False, False, True]


def test_lfu_breaks_a_tie_to_the_least_recent():
    ids, starts = _stream(_seq(0, 1, 2, 1))
    assert rx.lfu(ids, starts, 2).tolist() == [False, False, False, True]         # 2 evicts 0, not 1


def test_learned_evicts_the_one_predicted_to_return_last():
    # next gap = the last gap (at least 1 token): 0 at t2 has gap 2 -> predicted 4; 1 at t1 predicted 2.
    # t3: 2 evicts 0 (4 > 2); t4: 0 evicts 2 (predicted 4 > 1's 2); t5: 1 hits. LRU: t3 evicts 1.
    ids, starts = _stream(_seq(0, 1, 0, 2, 0, 1))
    assert rx.learned(ids, starts, 2, (1, 0, 0, 0), 1).tolist() == [False, False, True, False, False, True]
    assert rx.lru(ids, starts, 2).tolist() == [False, False, True, False, True, False]


def test_learned_places_the_prediction_at_its_layers_step():
    # three layers, one expert each, 2 slots, a constant predicted gap of 1 token: at layer 2 of t0
    # both residents are predicted for t1, layer 0's sooner (step 3) than layer 1's (step 4), so
    # layer 1's goes (LRU would evict layer 0's); at t1 layer 0's hits
    sel = np.zeros((3, 2, 1), np.int32)                          # ids: 0, 2, 4 | 0, 2, 4
    ids, starts = _stream(sel, 2)
    assert rx.learned(ids, starts, 2, (0, 0, 0, 1), 3).tolist() == [False, False, False, True, False, True]
    assert rx.lru(ids, starts, 2).tolist() == [False] * 6


def test_learned_as_replay_eviction_has_it_never_revises_an_overdue_prediction():
    # the expert whose predicted return has passed keeps its early prediction, so it outlasts
    # one just predicted: at t1 layer 1's miss evicts layer 0's expert (predicted for t2),
    # keeping layer 1's expert 0 (predicted for t1, not selected)
    sel = np.array([[[0], [0], [0]], [[0], [1], [0]]])           # ids: 0, 2 | 0, 3 | 0, 2
    ids, starts = _stream(sel, 2)
    assert rx.learned(ids, starts, 2, (0, 0, 0, 1), 2).tolist() == [False, False, True, False, False, True]
    # revised: at t1 layer 1's expert 0, due then and not selected, moves on to t2 and goes instead
    assert rx.learned(ids, starts, 2, (0, 0, 0, 1), 2, revise=True).tolist() == [False, False, True, False, True, False]


def test_a_layers_own_experts_never_evict_each_other():
    # k = 2 in 2 slots: at t1 the miss on 2 must evict 1, not 0 (this layer's hit, though least recent)
    sel = np.array([[[0, 1], [2, 0], [0, 2]]])
    ids, starts = _stream(sel)
    for name, policy in _policies().items():
        assert policy(ids, starts, 2).tolist() == [False, False, False, True, True, True], name


@pytest.mark.parametrize("seed", range(4))
def test_invariants_on_random_traces(seed):
    """After each layer's step its experts are all resident, within the slots; Belady's hits are
    at least every other policy's (the whole trace and the second half); share 0 is LRU."""
    rng = np.random.default_rng(seed)
    L, T, E, k = 4, 40, 12, 3
    sel = np.stack([np.stack([rng.choice(E, k, replace=False, p=np.arange(E, 0, -1) / (E * (E + 1) / 2))
                              for _ in range(T)]) for _ in range(L)])
    ids, starts = _stream(sel, E)
    hot = rx.hot_set(ids, starts, T // 2 * L, 6)
    coef = rx.fit_learned(ids, starts, L, T // 2)
    for C in (k, 7, 16, 30):
        def check(s, step, resident):
            assert set(step) <= resident and len(resident) <= C
        got = {name: p(ids, starts, C, on_step=check) for name, p in _policies(coef, L, hot if C - k >= 6 else ()).items()}
        half = starts[T // 2 * L]
        for name, h in got.items():
            assert got["belady"].sum() >= h.sum(), (name, C)
            assert got["belady"][half:].sum() >= h[half:].sum(), (name, C)
    out = rx.evaluate(sel, T // 2, [7, 16], shares=(0.0, 0.5), n_expert=E)
    for row in out["rows"]:
        pol = row["policies"]
        assert pol["pinned+lru@0"] == pol["lru"]
        assert pol["belady"]["gap_to_belady"] == 0 and all(v["gap_to_belady"] >= 0 for v in pol.values())
        assert row["best_online"] != "belady"


def test_hot_set_is_the_most_frequent_in_the_calibration_steps():
    ids, starts = _stream(_seq(3, 3, 1, 2, 2, 2, 1, 1, 1, 1))
    assert rx.hot_set(ids, starts, 6, 2) == [2, 3]               # steps 0..5: 2 x3, 3 x2, 1 x1
    assert rx.hot_set(ids, starts, 6, 9) == [2, 3, 1]            # never-seen ids are left out


def test_readahead_counts_used_and_wasted_prefetches():
    ids, starts = _stream(_seq(0, 1, 2))
    right = rx.readahead_lru(ids, starts, ids, starts, 2)
    assert right == dict(hits=3, misses=0, prefetched=3, used=3, wasted=0)
    # t0: 3 read, 0 missed; t1: 5 read (evicts 3), 6 not read: its victims would be 0 (the layer
    # before's, computing) or 5 (just read); 1 missed (evicts 0)
    pred_ids, pred_starts = _stream(np.array([[[3, -1], [5, 6]]]))
    wrong = rx.readahead_lru(ids[:2], starts[:3], pred_ids, pred_starts, 2)
    assert wrong == dict(hits=0, misses=2, prefetched=2, used=0, wasted=2)


def test_the_synthetic_trace_has_its_reuse():
    sel = rx.synthetic_trace(4, 200, 32, 4, zipf=0.0, stick=1.0, seed=1)
    assert sel.shape == (4, 200, 4) and rx.lag1_reuse(sel) == 1.0      # all kept: the same set throughout
    sel = rx.synthetic_trace(4, 200, 32, 4, zipf=0.0, stick=0.0, seed=1)
    assert all(len(set(r)) == 4 for r in sel.reshape(-1, 4).tolist())
    assert abs(rx.lag1_reuse(sel) - 4 / 32) < 0.05                     # uniform draws: k / E
