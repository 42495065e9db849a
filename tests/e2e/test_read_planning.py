"""Read planning (native/src/io.c, docs/design.md §14): the reads a sparse op issues against a
Python reference of the bridging rule, bridged bytes counted and dropped without changing any
output, the disk model measured at start, and the co-activation order of the converter."""

from __future__ import annotations

import numpy as np
import pytest

from leanstream_convert import order as od
from leanstream_ggml.model import manifest as mf
import reference as ref
from leanstream_ggml.native.engine import FFNEngine, candidate_blocks

LS_MAX_IOV = 64


def plan_reads(blocks, stride: int, bridge: int, max_bytes: int) -> list[tuple[int, int, int]]:
    """The planner's rule: blocks in file order; a read goes on through a gap of g unselected
    blocks while g * stride <= bridge, the read stays within max_bytes and LS_MAX_IOV pieces.
    Returns (first block, blocks, bridged bytes) per read."""
    max_gap = bridge // stride
    max_bytes = max(max_bytes, stride)
    reads: list[list[int]] = []   # [first, n_blocks, bridged, bytes, n_iov, end]
    for b in blocks:
        r = reads[-1] if reads else None
        if r is not None:
            gap = b - r[5]
            if 0 <= gap <= max_gap and r[3] + (gap + 1) * stride <= max_bytes and r[4] + (gap > 0) + 1 <= LS_MAX_IOV:
                r[1] += 1
                r[2] += gap * stride
                r[3] += (gap + 1) * stride
                r[4] += (gap > 0) + 1
                r[5] = b + 1
                continue
        reads.append([b, 1, 0, stride, 1, b + 1])
    return [(r[0], r[1], r[2]) for r in reads]


def test_plan_reads_reference():
    # gaps of 0, 1, 3 blocks; bridge of 2 blocks: the gap of 3 starts a new read
    assert plan_reads([0, 1, 3, 7, 8], 100, 200, 10_000) == [(0, 3, 100), (7, 2, 0)]
    assert plan_reads([0, 1, 3, 7, 8], 100, 0, 10_000) == [(0, 2, 0), (3, 1, 0), (7, 2, 0)]
    # the merge limit: at most 3 blocks' bytes per read
    assert plan_reads([0, 1, 2, 3], 100, 0, 300) == [(0, 3, 0), (3, 1, 0)]


def _engine(d, **kw) -> FFNEngine:
    m = mf.load(d)
    return FFNEngine([m.resolve(d, e.file) for e in m.layers], activation=m.activation, mode="leanstream",
                     sketch_paths=[m.resolve(d, f) for f in m.sketch_files()], **kw)


def _half_budget(d) -> int:
    with _engine(d) as eng:
        st = eng.stats()
        return int(st["resident_bytes"] + st["cache_capacity"] // 2)


@pytest.mark.parametrize("bridge_blocks", [0, 2, 6])
def test_reads_follow_the_plan_and_bridging_changes_no_output(smollm2_sketch_dir, bridge_blocks):
    d = smollm2_sketch_dir
    m = mf.load(d)
    il = 3
    rng = np.random.default_rng(1)
    x = rng.standard_t(3, size=m.n_embd).astype(np.float32)
    x /= np.sqrt((x ** 2).mean())
    budget = _half_budget(d)
    with _engine(d, memory_budget=budget, bridge_bytes=0) as eng0:
        stride = eng0.layer_info(il)["block_stride"]
        y0 = eng0.eval_layer(il, x, n_threads=2, x_res=x)
    with _engine(d, memory_budget=budget, bridge_bytes=bridge_blocks * stride, max_read_bytes=64 * stride) as eng:
        y = eng.eval_layer(il, x, n_threads=2, x_res=x)          # a cold cache: every candidate is read
        cand = np.sort(eng.last_candidates(il))
        st = eng.stats(il)
        used = eng.stats()["bridge_bytes"]
    assert used == bridge_blocks * stride
    want = plan_reads(cand.tolist(), stride, used, 64 * stride)
    assert st["reads_issued"] == len(want)
    bridged = sum(r[2] for r in want)
    assert st["bytes_bridged"] == bridged
    assert st["blocks_read"] == len(cand)
    assert st["bytes_read"] == len(cand) * stride + bridged
    if bridge_blocks:
        assert bridged > 0 and len(want) < len(plan_reads(cand.tolist(), stride, 0, 64 * stride))
    # the dropped bytes change nothing: same kept set, same output, bit for bit
    # (tests/native/test_sketch.py checks the op itself against the numpy FFN)
    np.testing.assert_array_equal(y, y0)


def test_disk_model_measured_at_start(smollm2_sketch_dir):
    d = smollm2_sketch_dir
    max_read = 128 << 10
    with _engine(d, memory_budget=_half_budget(d), max_read_bytes=max_read) as eng:
        st = eng.stats()
        stride = max(eng.layer_info(il)["block_stride"] for il in range(eng.n_layers))
    assert st["io_per_io_ns"] > 0 and st["io_bandwidth"] > 0
    model = int(st["io_per_io_ns"] * 1e-9 * st["io_bandwidth"])
    want = min(model, max_read // 2)
    if want < stride:
        want = 0
    assert abs(st["bridge_bytes"] - want) <= 1
    # a budget that holds everything reads each block once, in order: no probe, no bridging
    with _engine(d) as eng:
        st = eng.stats()
    assert st["io_per_io_ns"] == 0 and st["bridge_bytes"] == 0


def test_bridge_bytes_is_checked(smollm2_sketch_dir):
    from leanstream_ggml import Llama
    from leanstream_ggml.native import params

    with pytest.raises(params.ParameterError, match="bridge_bytes"):
        Llama(str(smollm2_sketch_dir), mode="leanstream", bridge_bytes=-5, verbose=False)


# ---- the order stage -----------------------------------------------------------------------------

def test_order_defaults_are_the_engines(smollm2_sketch_dir):
    with _engine(smollm2_sketch_dir) as eng:
        assert (eng.sparsity, eng.candidate_ratio) == pytest.approx((od.SPARSITY, od.CANDIDATE_RATIO))


def test_runs_against_brute_force():
    rng = np.random.default_rng(0)
    m = (rng.random((40, 30)) < 0.4).astype(np.uint8)
    order = rng.permutation(30)
    for gap in (0, 1, 3):
        total = 0
        for row in m[:, order]:
            reads = plan_reads(np.flatnonzero(row).tolist(), 1, gap, 10 ** 9)
            total += len(reads)
        assert od.runs(m, order, gap) == pytest.approx(total / len(m))


def test_coact_order_groups_neurons_read_together():
    # two groups of neurons, interleaved in file order, each read together by half the tokens
    n, t = 64, 200
    rng = np.random.default_rng(3)
    group = np.arange(n) % 2
    m = np.zeros((t, n), dtype=np.uint8)
    for i in range(t):
        m[i] = (group == (i % 2)) & (rng.random(n) < 0.9)
    for method in ("coact",):
        o = od.order_from_sets(m, method)
        assert sorted(o.tolist()) == list(range(n))
        assert od.runs(m, o) < 0.2 * od.runs(m, np.arange(n))
    f = od.order_from_sets(m, "freq")
    assert sorted(f.tolist()) == list(range(n))
    assert np.all(np.diff(m.sum(0).astype(np.int64)[f]) <= 0)


def test_read_sets_are_the_top_of_each_row():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((5, 50)).astype(np.float32)
    s = od.read_sets(a, 10)
    assert (s.sum(1) == 10).all()
    for row, sel in zip(np.abs(a), s.astype(bool)):
        assert row[sel].min() >= row[~sel].max()


def test_converted_files_follow_the_order(smollm2_sketch_dir):
    """The default conversion places neurons by co-activation: each block file's permutation is
    a real reordering (not GGUF order), the one the order stage chose."""
    d = smollm2_sketch_dir
    m = mf.load(d)
    w = ref.load_layer(m.resolve(d, m.layers[0].file))
    assert sorted(w.perm.tolist()) == list(range(m.n_ff))
    assert not np.array_equal(w.perm, np.arange(m.n_ff))
    assert candidate_blocks(m.n_ff, od.SPARSITY, od.CANDIDATE_RATIO) > 0


def test_leanstream_pins_the_calibration_hot_set(smollm2_sketch_dir):
    """Without predictors, the order stage's calibration frequencies rank the hot set: a budget
    below one token's reads is otherwise a cyclic scan that LRU evicts just before reuse."""
    from leanstream_ggml import Llama

    d = smollm2_sketch_dir
    m = mf.load(d)
    assert m.sketch.block_freq == "sketch/block_freq.npy" and m.block_freq_file() == m.sketch.block_freq
    assert m.sketch.block_freq in m.checksums
    freq = np.load(d / m.sketch.block_freq)
    assert freq.shape == (m.n_layer, m.layers[0].n_blocks) and freq.dtype == np.float32
    assert 0.0 <= freq.min() and freq.max() <= 1.0
    # each row is the read share of the calibration tokens: candidates / blocks on average
    n_read = candidate_blocks(m.n_ff, od.SPARSITY, od.CANDIDATE_RATIO)
    np.testing.assert_allclose(freq.mean(axis=1), n_read / m.n_ff, rtol=1e-4)
    llm = Llama(str(d), mode="leanstream", memory_budget=_half_budget(d), n_ctx=128, verbose=False)
    try:
        assert llm.hot_blocks > 0
    finally:
        llm.close()


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_streaming_holds_no_more_memory_as_it_goes(smollm2_sketch_dir):
    """Dense decode that streams half the FFN: what the process holds after the first tokens is
    what it holds after many (the memory plan counts the engine's tables once: a read queue sized
    for the worst case, whose entries became resident as its head went round, had grown by ~3 MB
    here, and by 35 MB on Qwen2.5-1.5B, over the first tens of tokens)."""
    d = smollm2_sketch_dir
    m = mf.load(d)
    ffn = sum(e.n_blocks * e.block_stride for e in m.layers)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((60, m.n_embd)).astype(np.float32)
    with FFNEngine([m.resolve(d, e.file) for e in m.layers], activation=m.activation, mode="dense",
                   memory_budget=ffn // 2) as e:
        for i, x in enumerate(xs):
            e.eval_layers(0, m.n_layer, x[None, :], n_threads=2)
            if i == 4:
                early, reads = _rss_anon(), e.stats()["reads_issued"]
        late = _rss_anon()
        assert e.stats()["reads_issued"] - reads > 10 * 256   # the queue's first length, many times over
    assert late - early < 2 * 2**20, (early, late)
