"""Read-ahead of the MoE op (native/src/moe_ahead.c): layer n+1's router applied to layer n's input
predicts layer n+1's experts, read while layer n computes. Against numpy: the prediction is the top
n_used of router . x (float64 here); the counters say what was predicted, read and used; the answers
are the same bits with read-ahead on, off, landing late or crowded into a small cache."""

from __future__ import annotations

import numpy as np
import pytest

from leanstream_ggml.native._native import LeanstreamError
from leanstream_ggml.native.moe import MoEEngine
from test_moe import N_EMBD, N_EXPERT, make_layer, routing

K = 2


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    d = tmp_path_factory.mktemp("ahead")
    paths = [d / "blk.0.bin", d / "blk.1.bin"]
    h = make_layer(paths[0], seed=3)
    make_layer(paths[1], il=1, seed=4)
    return paths, h["expert_stride"]


def router(seed=7):
    return np.random.default_rng(seed).standard_normal((N_EXPERT, N_EMBD)).astype(np.float32)


def predicted(R, x, k=K):
    """numpy's prediction: each token's top k of R . x, their union"""
    logits = x.astype(np.float64) @ R.astype(np.float64).T
    return set(np.argsort(-logits, axis=1)[:, :k].reshape(-1).tolist())


def others(chosen, n, k=K):
    """[n, k] ids none of which is in chosen"""
    rest = [e for e in range(N_EXPERT) if e not in chosen]
    return np.array([rest[:k]] * n, np.int32)


def two_steps(m, x, ids0, ids1, w):
    """layer 0 (predicting layer 1), then layer 1: their outputs"""
    return m.eval(0, x, ids0, w), m.eval(1, x, ids1, w)


def test_the_predicted_experts_are_read_early_and_used(two_layers):
    paths, _ = two_layers
    R = router()
    x, ids0, w = routing(1, K, seed=5)
    want = predicted(R, x)
    ids1 = np.array([sorted(want)], np.int32)
    with MoEEngine(paths, read_ahead="off") as off:
        base = two_steps(off, x, ids0, ids1, w)
    with MoEEngine(paths, read_ahead="on") as m:
        m.set_router(1, R, K)
        got = two_steps(m, x, ids0, ids1, w)
        s = m.stats(1)
        assert (s["ahead_ops"], s["ahead_routed"], s["ahead_predicted"]) == (1, K, K)
        assert (s["ahead_candidates"], s["ahead_useful"], s["ahead_reads"], s["ahead_used"]) == (K, K, K, K)
        assert s["misses"] == 0 and s["ahead_recall"] == 1.0 and s["ahead_wasted_bytes"] == 0
        assert s["bytes_read"] == K * s["slot_bytes"]      # read once, early
        assert m.stats(0)["ahead_ops"] == 0                # layer 0: nothing predicts it
        assert m.stats()["router_known"] == 1 and m.stats()["ahead_on"] == 1
    for a, b in zip(got, base):
        assert np.array_equal(a, b)


def test_a_wrong_prediction_is_wasted_bytes_and_auto_turns_the_layer_off_and_on(two_layers):
    paths, stride = two_layers
    R = router()
    # 8 slots for 16 experts: what was read does not stay, so there are candidates to score
    with MoEEngine(paths, read_ahead="auto", memory_budget=8 * stride, ahead_min_precision=0.5) as m:
        m.set_router(1, R, K)
        for step in range(12):   # every prediction wrong: precision falls below 0.5
            x, ids0, w = routing(1, K, seed=100 + step)
            m.eval(0, x, ids0, w)
            m.eval(1, x, others(predicted(R, x), 1), w)
        s = m.stats(1)
        assert s["ahead_predicted"] == 0 and s["ahead_used"] == 0 and s["ahead_reads"] > 0
        assert s["ahead_wasted_bytes"] == s["ahead_reads"] * s["slot_bytes"]
        assert s["ahead_on"] == 0 and s["ahead_reads"] < 12 * K   # turned off before the end
        reads, ops = s["ahead_reads"], s["ahead_ops"]
        for step in range(64):   # every prediction right: one op in 16 scored while off, on again
            x, ids0, w = routing(1, K, seed=200 + step)
            m.eval(0, x, ids0, w)
            m.eval(1, x, np.array([sorted(predicted(R, x))], np.int32), w)
        s = m.stats(1)
        assert s["ahead_on"] == 1 and s["ahead_reads"] > reads and s["ahead_used"] > 0
        assert s["ahead_ops"] - ops < 64    # not every op predicted while it was off


def test_reads_still_landing_and_a_crowded_cache_give_the_same_bits(two_layers):
    paths, stride = two_layers
    R = router()
    # a batch of 3 landing late; one token in caches of 4 and 5 slots (read-ahead may take one)
    for n, runs in ((3, [dict(test_hooks={"io_delay_us": 20000}), dict(test_hooks={"io_delay_us": 3000})]),
                    (1, [dict(memory_budget=4 * stride), dict(memory_budget=5 * stride, test_hooks={"io_delay_us": 3000})])):
        x, ids0, w = routing(n, K, seed=9)
        ids1 = np.array([sorted(predicted(R, x[t:t + 1])) for t in range(n)], np.int32)
        with MoEEngine(paths, read_ahead="off") as off:
            base = [two_steps(off, x, ids0, ids1, w) for _ in range(2)]
        for run in runs:
            with MoEEngine(paths, read_ahead="on", **run) as m:
                m.set_router(1, R, K)
                for rep in range(2):
                    for a, b in zip(two_steps(m, x, ids0, ids1, w), base[rep]):
                        assert np.array_equal(a, b), run
                assert m.stats(1)["ahead_used"] > 0, run


def test_a_prefill_sized_batch_is_not_read_ahead(two_layers):
    paths, _ = two_layers
    x, ids0, w = routing(9, K, seed=11)
    with MoEEngine(paths, read_ahead="on", ahead_max_tokens=8) as m:
        m.set_router(1, router(), K)
        two_steps(m, x, ids0, ids0, w)
        assert m.stats(1)["ahead_ops"] == 0 and m.stats(1)["ahead_reads"] == 0


def test_routing_counts_are_the_router_s_choices(two_layers):
    paths, _ = two_layers
    x, ids, w = routing(7, 3, seed=13)
    with MoEEngine(paths) as m:
        m.eval(0, x, ids, w)
        m.eval(0, x[:2], ids[:2], w[:2])
        want = np.bincount(np.concatenate([ids.reshape(-1), ids[:2].reshape(-1)]), minlength=N_EXPERT)
        assert np.array_equal(m.routing_counts(0), want)
        assert not m.routing_counts(1).any()
        m.reset_stats()
        assert not m.routing_counts(0).any()


def test_bad_routers_and_settings_are_refused(two_layers):
    paths, _ = two_layers
    with MoEEngine(paths) as m:
        with pytest.raises(LeanstreamError, match="does not fit"):
            m.set_router(1, router()[:4], K)
        with pytest.raises(LeanstreamError, match="does not fit"):
            m.set_router(1, router(), N_EXPERT + 1)
    with pytest.raises(ValueError, match="read_ahead"):
        MoEEngine(paths, read_ahead="sometimes")
    with pytest.raises(LeanstreamError, match="ahead_min_precision"):
        MoEEngine(paths, ahead_min_precision=1.5)


def lfu_reference(prior, steps, n_slots, lfu=True):
    """numpy/Python reference of the MoE cache's LFU (cache.c pick_victim, moe.c's counts): per op
    each used expert counts one; its resident ones are hits, pinned; each missing one takes a free
    slot or evicts the unpinned resident expert of fewest uses, the least recently released of
    equals; an op releases its experts in compute order (resident first, then missing, each by
    index). lfu False: LRU (the least recently released). Returns the misses of each op."""
    uses, resident, order, misses = list(prior), {}, 0, []
    for ids in steps:
        used = sorted(set(ids))
        for e in used:
            uses[e] += 1
        hits = [e for e in used if e in resident]
        missing = [e for e in used if e not in resident]
        for e in missing:
            if len(resident) >= n_slots:
                victim = min((x for x in resident if x not in used), key=lambda x: (uses[x] if lfu else 0, resident[x]))
                del resident[victim]
            resident[e] = -1   # pinned while the op runs
        for e in hits + missing:
            order += 1
            resident[e] = order
        misses.append(len(missing))
    return misses


@pytest.mark.parametrize("evict", ["lfu", "lru"])
def test_the_cache_evicts_as_the_reference_does(two_layers, evict):
    paths, stride = two_layers
    rng = np.random.default_rng(21)
    prior = rng.integers(0, 20, N_EXPERT)
    steps = [rng.choice(N_EXPERT, K, replace=False, p=np.arange(1, N_EXPERT + 1) / (N_EXPERT * (N_EXPERT + 1) / 2))
             for _ in range(40)]
    want = lfu_reference(prior, steps, 4, lfu=evict == "lfu")
    assert want != lfu_reference(prior, steps, 4, lfu=evict != "lfu")   # the two policies differ here
    with MoEEngine(paths[:1], memory_budget=4 * stride, evict=evict, read_ahead="off") as m:
        if evict == "lfu":
            m.set_uses(0, prior)
        got = []
        for ids in steps:
            x, _, w = routing(1, K, seed=int(ids[0]))
            before = m.stats()["misses"]
            m.eval(0, x, np.array([ids], np.int32), w)
            got.append(m.stats()["misses"] - before)
    assert got == want


def test_lfu_over_two_layers_and_many_ops_is_the_reference_s(two_layers):
    """The heap that finds LFU's victim (cache.c) against the reference over both layers' experts
    (keys layer * N_EXPERT + expert), 300 ops alternating layers, 6 slots, a prior on each."""
    paths, stride = two_layers
    rng = np.random.default_rng(5)
    prior = rng.integers(0, 6, 2 * N_EXPERT)
    p = np.arange(1, N_EXPERT + 1) ** 1.5
    steps = [(i % 2, rng.choice(N_EXPERT, K, replace=False, p=p / p.sum())) for i in range(300)]
    want = lfu_reference(prior, [[il * N_EXPERT + e for e in ids] for il, ids in steps], 6)
    with MoEEngine(paths, memory_budget=6 * stride, read_ahead="off") as m:
        m.set_uses(0, prior[:N_EXPERT])
        m.set_uses(1, prior[N_EXPERT:])
        got = []
        for il, ids in steps:
            x, _, w = routing(1, K, seed=int(ids[0]))
            before = m.stats()["misses"]
            m.eval(il, x, np.array([ids], np.int32), w)
            got.append(m.stats()["misses"] - before)
    assert got == want


def test_only_the_best_scored_predictions_are_read_ahead(two_layers):
    """ahead_top 1: of each token's K predictions only the best-scored is a candidate (read early);
    recall is still scored on all K."""
    paths, _ = two_layers
    R = router()
    x, ids0, w = routing(1, K, seed=5)
    logits = x.astype(np.float64) @ R.astype(np.float64).T
    best = int(np.argmax(logits[0]))
    ids1 = np.array([sorted(predicted(R, x))], np.int32)
    with MoEEngine(paths, read_ahead="on", ahead_top=1) as m:
        m.set_router(1, R, K)
        two_steps(m, x, ids0, ids1, w)
        s = m.stats(1)
        assert (s["ahead_predicted"], s["ahead_candidates"], s["ahead_reads"], s["ahead_used"]) == (K, 1, 1, 1)
        assert s["misses"] == K - 1
    assert best in ids1[0]


def test_read_ahead_never_evicts_a_predicted_resident_expert(two_layers):
    """Under LFU the least used resident expert gives way; a predicted one still resident is held
    while the read-ahead takes its slots, so the next op finds every predicted expert."""
    paths, stride = two_layers
    R = router()
    x, _, w = routing(1, K, seed=5)
    p1, p2 = sorted(predicted(R, x))
    q1, q2 = [e for e in range(N_EXPERT) if e not in (p1, p2)][:2]
    l0 = np.array([[0, 1]], np.int32)
    with MoEEngine(paths, memory_budget=5 * stride, read_ahead="on", ahead_top=K) as m:
        m.eval(1, x, np.array([[q1, q2]], np.int32), w)
        m.eval(1, x, np.array([[p1, q1]], np.int32), w)
        m.eval(0, x, l0, w)                       # 5 slots: layer 0's two, p1, q1, q2
        uses = np.zeros(N_EXPERT, np.int64)
        uses[[q1, q2]] = 100                      # p1 the least used: LFU's victim but for the hold
        m.set_uses(1, uses)
        m.set_uses(0, np.full(N_EXPERT, 100))
        m.set_router(1, R, K)
        m.reset_stats()
        m.eval(0, x, l0, w)                       # predicts {p1, p2}; reads p2
        m.eval(1, x, np.array([[p1, p2]], np.int32), w)
        s = m.stats(1)
        assert s["ahead_reads"] == 1 and s["ahead_used"] == 1 and s["misses"] == 0
