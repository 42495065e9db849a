"""Sparse decode in every mode: oracle priorities, predictors and their prefetch, the
budget, chunked prefill, and I/O faults — each checked against the numpy reference over the
neuron set the engine computed (same bound as tests/native/test_op.py)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from leanstream_convert import convert
from leanstream_convert import blockfile
from gguf_synth import write_tiny_model
from leanstream_ggml.native._native import LeanstreamError
from leanstream_ggml.native.engine import FFNEngine
from reference import ffn_reference, load_layer

N_EMBD, N_FF, N_LAYER, K = 128, 384, 3, 2
SPARSE_MODES = ["oneshot", "dejavu+", "powerinfer2", "leanstream"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("sparse")
    write_tiny_model(d / "tiny.gguf", arch="llama", n_layer=N_LAYER, n_embd=N_EMBD, n_ff=N_FF,
                     types={"ffn": "Q8_0"}, seed=5)
    rng = np.random.default_rng(3)
    m = convert(d / "tiny.gguf", d / "lsm", k=K, progress=False, sketch="none",
                permutation={il: rng.permutation(N_FF) for il in range(N_LAYER)})
    paths = [m.layer_path(d / "lsm", il) for il in range(N_LAYER)]
    weights = [load_layer(p) for p in paths]
    return paths, weights, blockfile.read_header(paths[0])


@pytest.fixture(scope="module")
def predictors(model, tmp_path_factory):
    """Untrained (random) hashing predictors: the engine must follow whatever they say."""
    pytest.importorskip("torch", reason="predictor files are made with torch (convert extra)")
    from pred_synth import write_random_predictors

    paths, _, _ = model
    return write_random_predictors(paths[0].parent.parent)


def n_selected(n_blocks, s):
    return max(1, min(n_blocks, int((1.0 - s) * n_blocks + 0.5)))


def neurons_of(blocks, w, k=K):
    ids = w.perm.reshape(-1, k)[np.asarray(blocks)].reshape(-1)
    return ids[ids >= 0]


def _x(seed, n=1):
    return np.random.default_rng(seed).standard_normal((n, N_EMBD)).astype(np.float32)


def _check(y, ref):
    err = np.abs(y - ref).max()
    assert err <= 1e-3 * np.abs(ref).max() + 1e-5, f"max err {err}"


@pytest.mark.parametrize("mode", SPARSE_MODES)
@pytest.mark.parametrize("sparsity", [0.5, 0.8])
def test_oracle_priorities_select_the_top_blocks(model, mode, sparsity):
    paths, weights, h = model
    rng = np.random.default_rng(11)
    # no calibration ranking here: the modes that pin a hot set pin none (hot_fraction 0)
    with FFNEngine(paths, mode=mode, sparsity=sparsity, hot_fraction=0.0) as e:
        for il in range(N_LAYER):
            prio = rng.permutation(h.n_blocks).astype(np.float32)  # distinct: one right answer
            e.set_priorities(il, prio)
            x = _x(il)
            y = e.eval_layer(il, x, n_threads=2, x_res=x[0])
            top = np.argsort(-prio)[:n_selected(h.n_blocks, sparsity)]
            plan = e.last_plan(il)
            assert sorted(plan) == sorted(top)
            assert list(plan) == sorted(plan)   # computed in file order (reads merge)
            _check(y, ffn_reference(weights[il], x, neurons=neurons_of(plan, weights[il])))


def test_predictors_drive_selection_and_prefetch(model, predictors):
    torch = pytest.importorskip("torch")
    paths, weights, h = model
    pred_paths, pred_models = predictors
    s = 0.5
    n_sel = n_selected(h.n_blocks, s)
    with FFNEngine(paths, mode="leanstream", sparsity=s, predictor_paths=pred_paths) as e:
        xs = [_x(10 + il) for il in range(N_LAYER)]
        for il in range(N_LAYER):
            y = e.eval_layer(il, xs[il], n_threads=2, x_res=xs[il][0])
            plan = e.last_plan(il)
            assert len(plan) == n_sel
            _check(y, ffn_reference(weights[il], xs[il], neurons=neurons_of(plan, weights[il])))
            if il == 0:  # layer 0 ranks from its own input: exactly the predictor's top set
                with torch.no_grad():
                    prio = pred_models[0].infer(torch.as_tensor(xs[0])).numpy()[0]
                # a top set (the predictor's scores tie often: any tie-break at the cut is right)
                cut = np.sort(prio)[::-1][n_sel - 1]
                rest = np.setdiff1d(np.arange(h.n_blocks), plan)
                assert prio[plan].min() >= cut >= prio[rest].max()
        st = e.stats()
        # layers 1..n-1 were prefetched from the layer before (layer-ahead input), n_sel each
        assert [e.stats(il)["blocks_prefetched"] for il in range(N_LAYER)] == [0] + [n_sel] * (N_LAYER - 1)
        assert st["predictor_ns"] > 0


def test_streamed_sparse_equals_cached_under_io_delays(model, predictors):
    paths, _, h = model
    pred_paths, _ = predictors
    s = 0.5
    ws = n_selected(h.n_blocks, s) * h.block_stride
    runs = []
    # the third run's read queue starts 1 long and doubles as reads (one block each) wait behind the
    # slow ones; the last one's holds 2 reads: submits overflow it and fall back to reading
    # synchronously on the planning thread. Neither may change a bit
    one_block = {"max_read_bytes": 4096, "bridge_bytes": 0}
    for budget, delay, qcap, qstart in [(None, 0, 0, 0), (int(ws * 1.5), 400, 0, 0), (int(ws * 1.5), 400, 0, 1),
                                        (int(ws * 1.5), 200, 2, 0)]:
        with FFNEngine(paths, mode="leanstream", sparsity=s, predictor_paths=pred_paths, memory_budget=budget,
                       n_io_threads=3, test_hooks={"io_delay_us": delay, "io_queue_cap": qcap,
                                                   "io_queue_start": qstart},
                       **(one_block if qstart else {})) as e:
            ys = []
            for token in range(3):
                for il in range(N_LAYER):
                    x = _x(100 * token + il)
                    ys.append(e.eval_layer(il, x, n_threads=2, x_res=x[0]))
                    st = e.stats()
                    assert st["cache_bytes"] <= st["cache_capacity"]
                    if budget:
                        assert st["cache_capacity"] <= budget
            runs.append(ys)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert np.array_equal(a, b)


def test_cache_modes(model):
    """Same token twice: dejavu+ keeps the blocks (second pass all hits), oneshot re-reads."""
    paths, _, h = model
    prio = np.arange(h.n_blocks, dtype=np.float32)
    reads = {}
    for mode in ["oneshot", "dejavu+"]:
        with FFNEngine(paths, mode=mode, sparsity=0.5) as e:
            for _ in range(2):
                e.set_priorities(0, prio)
                e.eval_layer(0, _x(0), x_res=_x(0)[0])
            reads[mode] = e.stats()["blocks_read"]
    n_sel = n_selected(h.n_blocks, 0.5)
    assert reads["dejavu+"] == n_sel
    assert reads["oneshot"] == 2 * n_sel


def test_powerinfer2_hot_blocks_stay_resident(model):
    paths, _, h = model
    n_sel = n_selected(h.n_blocks, 0.5)
    hot = np.arange(n_sel // 2, dtype=np.int32)
    budget = (n_sel + len(hot) + 4) * h.block_stride  # hot set + one working set + a little
    with FFNEngine(paths, mode="powerinfer2", sparsity=0.5, memory_budget=budget, hot_fraction=0.0) as e:
        e.set_hot_blocks(0, hot)
        rng = np.random.default_rng(0)
        for il in [0, 1, 2, 0, 1, 2, 0]:
            prio = rng.standard_normal(h.n_blocks).astype(np.float32)
            if il == 0:
                prio[hot] += 100.0  # hot blocks selected every time for layer 0
            e.set_priorities(il, prio)
            e.eval_layer(il, _x(il), x_res=_x(il)[0])
        # the hot blocks were read once although layers 1 and 2 cycled through the cache
        assert e.stats(0)["blocks_read"] <= len(hot) + 3 * (n_sel - len(hot))


@pytest.mark.parametrize("mode,fraction", [("powerinfer2", None), ("leanstream", 0.3), ("leanstream", 0.9)])
def test_hot_set_sized_and_chosen_by_the_engine(model, mode, fraction):
    """The engine sizes the hot set from its own slot count and takes the best-ranked blocks of
    all layers (numpy reference: a stable sort of the flattened ranking)."""
    paths, _, h = model
    n_sel = n_selected(h.n_blocks, 0.5)
    slots = 5 * n_sel
    rank = np.random.default_rng(3).random((N_LAYER, h.n_blocks)).astype(np.float32)
    rank[1, :7] = rank[0, 0]                      # ties: broken by (layer, block) order
    with FFNEngine(paths, mode=mode, sparsity=0.5, memory_budget=slots * h.block_stride, hot_fraction=fraction,
                   block_rank=rank) as e:
        f = 0.5 if fraction is None else fraction       # the mode's default share
        n_hot = max(0, min(int(f * slots), slots - 2 * n_sel))
        assert e.stats()["hot_blocks"] == n_hot and e.hot_fraction == f
        order = np.argsort(-rank, axis=None, kind="stable")[:n_hot]
        want = np.zeros(rank.size, bool)
        want[order] = True
        prio = np.zeros(h.n_blocks, np.float32)
        for il in range(N_LAYER):   # hot blocks stay resident once computed: compute every block once
            for start in range(0, h.n_blocks, n_sel):
                p = prio.copy()
                p[start:start + n_sel] = 1.0
                e.set_priorities(il, p)
                e.eval_layer(il, _x(il), x_res=_x(il)[0])
        for _ in range(2):   # churn the rest of the cache
            for il in range(N_LAYER):
                e.set_priorities(il, np.random.default_rng(il).random(h.n_blocks).astype(np.float32))
                e.eval_layer(il, _x(il), x_res=_x(il)[0])
        resident = np.concatenate([e.resident(il) for il in range(N_LAYER)])
        assert resident[want].all()


def test_powerinfer2_needs_a_ranking(model):
    paths, _, h = model
    with pytest.raises(LeanstreamError, match="block_rank"):
        FFNEngine(paths, mode="powerinfer2", sparsity=0.5)
    with FFNEngine(paths, mode="leanstream", sparsity=0.5) as e:   # leanstream pins only if it can
        assert e.stats()["hot_blocks"] == 0


def test_budget_below_the_working_set_is_a_clear_error(model):
    paths, _, h = model
    with pytest.raises(LeanstreamError, match="too small.*working set"):
        FFNEngine(paths, mode="leanstream", sparsity=0.5, memory_budget=10 * h.block_stride)


def test_prefill_is_dense_and_chunked_under_a_small_budget(model):
    paths, weights, h = model
    n_sel = n_selected(h.n_blocks, 0.5)
    with FFNEngine(paths, mode="leanstream", sparsity=0.5, memory_budget=n_sel * h.block_stride) as e:
        x = _x(7, n=5)
        for il in range(N_LAYER):
            _check(e.eval_layer(il, x, n_threads=2), ffn_reference(weights[il], x))
        st = e.stats()
        assert st["cache_bytes"] <= st["cache_capacity"] <= n_sel * h.block_stride


def test_sparse_read_error_then_recovery(model, tmp_path):
    paths, weights, h = model
    local = []
    for p in paths:
        shutil.copy(p, tmp_path / p.name)
        local.append(tmp_path / p.name)
    with FFNEngine(local, mode="oneshot", sparsity=0.5) as e:  # oneshot: every call reads
        prio = np.arange(h.n_blocks, dtype=np.float32)
        e.set_priorities(1, prio)
        good = e.eval_layer(1, _x(1), x_res=_x(1)[0])
        data = local[1].read_bytes()
        os.truncate(local[1], h.data_offset + h.block_stride)
        e.set_priorities(1, prio)
        with pytest.raises(LeanstreamError, match=r"blk\.1\.bin"):
            e.eval_layer(1, _x(1), x_res=_x(1)[0])
        local[1].write_bytes(data)
        e.set_priorities(1, prio)
        assert np.array_equal(e.eval_layer(1, _x(1), x_res=_x(1)[0]), good)


def test_eviction_is_lru(model):
    """Layer 1 needs 8 slots held by layer 0: LRU evicts layer 0's least recently released blocks
    (its first ones in plan order, released first)."""
    paths, _, h = model
    n_sel = n_selected(h.n_blocks, 0.5)
    budget = (2 * n_sel - 8) * h.block_stride
    with FFNEngine(paths, mode="dejavu+", sparsity=0.5, memory_budget=budget) as e:
        p0 = np.arange(h.n_blocks, dtype=np.float32)[::-1].copy()  # block 0 most important
        e.set_priorities(0, p0)
        e.eval_layer(0, _x(0), x_res=_x(0)[0])
        plan0 = e.last_plan(0)
        e.set_priorities(1, np.arange(h.n_blocks, dtype=np.float32))
        e.eval_layer(1, _x(1), x_res=_x(1)[0])
        kept = e.resident(0)
        evicted = [b for b in plan0 if not kept[b]]
        assert len(evicted) == 8
        assert sorted(evicted) == sorted(plan0[:8])
