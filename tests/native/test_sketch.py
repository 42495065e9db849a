"""The exact-input selection (docs/design.md §12): LS2 sketch rows, the native scorer against its
numpy reference, the cascade op (candidates -> exact h -> down for the kept set) against the
numpy FFN reference, honest byte counts, the sketch file's integrity and its share of the budget,
and the decode quality it keeps on the real SmolLM2."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import reference as ref
from leanstream_convert import sketch as skf
from leanstream_ggml.model import manifest as mf
from leanstream_ggml.native._native import LeanstreamError, lib
from leanstream_ggml.native.engine import FFNEngine


def _engine(d, **kw) -> FFNEngine:
    m = mf.load(d)
    kw.setdefault("mode", "leanstream")
    return FFNEngine([m.resolve(d, e.file) for e in m.layers], activation=m.activation,
                     sketch_paths=[m.resolve(d, f) for f in m.sketch_files()], **kw)


def _inputs(n_embd: int, n: int, seed: int = 0) -> np.ndarray:
    """FFN-input-like vectors: RMS-normalised, heavy-tailed like real residual streams."""
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, size=(n, n_embd)).astype(np.float32)
    return x / np.sqrt((x ** 2).mean(1, keepdims=True))


# ---- LS2 rows ------------------------------------------------------------------------------------

def test_ls2_rows_roundtrip_and_error():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((50, 192)) * rng.uniform(0.01, 2, (50, 1))).astype(np.float32)
    w[3] = 0.0                                      # an all-zero row stays zero
    rows = skf.quantize_rows(w)
    assert rows.shape == (50, skf.row_bytes(192)) == (50, 60)
    v = ref.dequantize_rows(rows, 192)
    assert np.all(v[3] == 0.0)
    g = w.reshape(50, -1, 32)
    # every value lies within half a level of its group's scale ... or is clipped at the outer level
    d = rows[:, :12].copy().view("<f2").astype(np.float32)[:, :, None]
    err = np.abs(g - v.reshape(50, -1, 32))
    assert np.all((err <= d / 2 * (1 + 1e-3) + 1e-7) | (np.abs(g) >= 1.5 * d))
    # least squares over the scale grid: better than the plain max-scaled quantizer
    plain = (np.clip(np.floor(g / (np.abs(g).max(-1, keepdims=True) / 1.5 + 1e-30) + 2), 0, 3) - 1.5) \
        * (np.abs(g).max(-1, keepdims=True) / 1.5)
    assert ((g - v.reshape(50, -1, 32)) ** 2).sum() < 0.8 * ((g - plain) ** 2).sum()
    with pytest.raises(ValueError, match="multiple of 64"):
        skf.quantize_rows(np.zeros((2, 96), np.float32))


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_native_ls2_rows_equal_the_numpy_reference(n_threads):
    """The converter's quantizer (ls_sketch_quantize_ls2) writes the reference's rows: the same
    float32 operations in the same order, no fused multiply-add. Ties between two trial scales
    could in principle break differently in the last bit; random weights of several magnitudes,
    zero rows and groups, and exact level values show none."""
    rng = np.random.default_rng(7)
    w = (rng.standard_t(4, (301, 256)) * rng.uniform(1e-4, 3, (301, 1))).astype(np.float32)
    w[5] = 0.0
    w[9, :32] = 0.0
    w[11] = np.tile(np.array([-1.5, -0.5, 0.5, 1.5], np.float32), 64) * 0.25   # exactly on the levels
    want = skf.quantize_rows(w)
    got = skf.quantize_rows_native(w, n_threads)
    assert got.shape == want.shape
    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="multiple of 64"):
        skf.quantize_rows_native(np.zeros((2, 96), np.float32))


def test_sketch_file_roundtrip(tmp_path):
    rows = skf.quantize_rows(np.ones((4, 64), np.float32))
    data = skf.make_file(2, 64, 2, skf.LS2, rows, rows, np.array([1, 1, 1, 0], np.float32))
    p = tmp_path / "blk.2.lssk"
    p.write_bytes(data)
    h, g, u, w = skf.read(p)
    assert (h.il, h.n_rows, h.k, h.row_bytes) == (2, 4, 2, 20) and np.array_equal(g, rows)
    bad = bytearray(data)
    bad[-9] ^= 1
    p.write_bytes(bytes(bad))
    with pytest.raises(skf.SketchFileError, match="data checksum"):
        skf.read(p)


# ---- the native scorer and the cascade op on the real SmolLM2 --------------------------------------

def test_scorer_matches_numpy_reference(smollm2_sketch_dir):
    d = smollm2_sketch_dir
    m = mf.load(d)
    with _engine(d) as eng:
        for il, x in zip((0, 13, m.n_layer - 1), _inputs(m.n_embd, 3)):
            got = eng.sketch_scores(il, x)
            _, g, u, w = skf.read(m.resolve(d, m.sketch_files()[il]))
            want = ref.reference_scores(g, u, w, x, m.block.k, lambda z: ref.act(z, m.activation))
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("sparsity,ratio", [(0.5, 1.5), (0.3, 1.25), (0.6, 1.0)])
def test_cascade_op_matches_reference(smollm2_sketch_dir, sparsity, ratio):
    d = smollm2_sketch_dir
    m = mf.load(d)
    il = 5
    w = ref.load_layer(m.resolve(d, m.layers[il].file))
    with _engine(d, sparsity=sparsity, candidate_ratio=ratio) as eng:
        info = eng.layer_info(il)
        nb = info["n_blocks"]
        n_kept = int(lib.ls_kept_blocks(nb, sparsity))
        n_cand = min(nb, int(np.ceil(ratio * n_kept - 1e-9)))
        for x in _inputs(m.n_embd, 2, seed=7):
            eng.reset_stats()
            y = eng.eval_layer(il, x, n_threads=2, x_res=x)
            cand, kept = eng.last_candidates(il), eng.last_plan(il)
            assert len(cand) == n_cand and len(kept) == n_kept
            # candidates: the top n_cand of the sketch's scores
            sc = eng.sketch_scores(il, x)
            assert sc[cand].min() >= np.sort(sc)[::-1][n_cand - 1]
            # kept: the candidates with the largest exact |h| (numpy, float64)
            xr = ref.round_like_ggml(x, w.gate_type).astype(np.float64)
            h = np.abs(ref.act(w.gate.astype(np.float64) @ xr, m.activation) * (w.up.astype(np.float64) @ xr))
            hb = h[w.perm]
            rest = np.setdiff1d(cand, kept)
            if len(rest):
                assert hb[kept].min() >= hb[rest].max() - 1e-3 * hb.max()   # ties within rounding
            # output: the numpy FFN over exactly the kept neurons
            want = ref.ffn_reference(w, x, activation=m.activation, neurons=w.perm[kept])[0]
            np.testing.assert_allclose(y[0], want, rtol=0, atol=2e-3 * float(np.abs(want).max()))
            # bytes: gate/up of every candidate, down of the kept ones
            st = eng.stats(il)
            L = m.layers[il]
            gu = info["block_payload"] - m.block.k * _down_col_bytes(L.down_type, m.n_embd)
            dn = m.block.k * _down_col_bytes(L.down_type, m.n_embd)
            assert st["bytes_computed"] == n_cand * gu + n_kept * dn
            assert st["blocks_candidates"] == n_cand and st["down_skipped"] == n_cand - n_kept


def test_resident_layer_selects_from_every_block(smollm2_sketch_dir):
    """Once a prefill has made the whole layer resident for good (unlimited budget), computing every
    gate/up row costs fewer bytes than the sketch plus 1.5x the kept blocks' rows: the cascade skips
    the sketch, and the kept set is the exact-|h| top over the whole layer."""
    d = smollm2_sketch_dir
    m = mf.load(d)
    il = 3
    w = ref.load_layer(m.resolve(d, m.layers[il].file))
    with _engine(d, sparsity=0.5) as eng:
        info = eng.layer_info(il)
        nb = info["n_blocks"]
        n_kept = int(lib.ls_kept_blocks(nb, 0.5))
        eng.eval_layer(il, _inputs(m.n_embd, 8, seed=3), n_threads=2)   # prefill: the whole layer is read
        assert eng.layer_info(il)["split_layout"] == 1   # and rewritten: gate/up rows apart from down columns
        for x in _inputs(m.n_embd, 2, seed=11):
            eng.reset_stats()
            y = eng.eval_layer(il, x, n_threads=2, x_res=x)
            cand, kept = eng.last_candidates(il), eng.last_plan(il)
            assert len(cand) == nb and len(kept) == n_kept
            st = eng.stats(il)
            assert st["scorer_ns"] == 0 and st["blocks_candidates"] == nb   # the sketch was not read
            xr = ref.round_like_ggml(x, w.gate_type).astype(np.float64)
            hb = np.abs(ref.act(w.gate.astype(np.float64) @ xr, m.activation) * (w.up.astype(np.float64) @ xr))[w.perm]
            rest = np.setdiff1d(np.arange(nb), kept)
            assert hb[kept].min() >= hb[rest].max() - 1e-3 * hb.max()
            want = ref.ffn_reference(w, x, activation=m.activation, neurons=w.perm[kept])[0]
            np.testing.assert_allclose(y[0], want, rtol=0, atol=2e-3 * float(np.abs(want).max()))


def test_calibration_budget_selects_through_the_sketch(smollm2_sketch_dir):
    """The converter calibrates quality= one block short of the whole FFN, so its table is the
    sketch's candidates (what every budget below the FFN's size gets), not the better exact
    selection of layers resident for good."""
    from leanstream_convert.calibrate import _sketch_budget
    from leanstream_ggml import Llama

    d = smollm2_sketch_dir
    m = mf.load(d)
    kw = dict(n_ctx=64, n_batch=64, n_threads=2, verbose=False)
    budget = _sketch_budget(Llama, d, m, kw)
    llm = Llama(str(d), mode="leanstream", sparsity=0.5, memory_budget=budget, hot_fraction=0.0, **kw)
    try:
        toks = llm.tokenize(b"The bridge was built of stone and iron over the river")
        llm.eval(toks[:8])
        eng = llm._engine
        eng.reset_stats()
        for t in toks[8:12]:
            llm.eval([t])
        st = eng.stats()
        nb = sum(L.n_blocks for L in m.layers)
        assert 0 < st["blocks_candidates"] < 4 * nb and st["scorer_ns"] > 0
        assert all(eng.layer_info(il)["split_layout"] == 0 for il in range(m.n_layer))
    finally:
        llm.close()


def _down_col_bytes(t: str, n_embd: int) -> int:
    return {"q8_0": n_embd // 32 * 34, "f16": 2 * n_embd, "f32": 4 * n_embd}[t]


def test_budget_covers_the_sketch(smollm2_sketch_dir):
    d = smollm2_sketch_dir
    m = mf.load(d)
    with _engine(d) as eng:
        sketch = eng.stats()["resident_bytes"]
    assert sketch == m.sketch.bytes
    stride = m.layers[0].block_stride
    # a budget that holds the sketch and barely one layer's candidates works; its cache is what is left
    need = sketch + stride * min(m.layers[0].n_blocks, int(np.ceil(1.5 * lib.ls_kept_blocks(m.layers[0].n_blocks, 0.5))))
    with _engine(d, memory_budget=need + 2 * stride) as eng:
        assert eng.stats()["cache_capacity"] == ((need + 2 * stride - sketch) // stride) * stride
    with pytest.raises(LeanstreamError, match="sketches and predictors take"):
        _engine(d, memory_budget=sketch + stride)


def test_hot_blocks_lose_their_sketch_rows(smollm2_sketch_dir):
    """Under a budget, the hot set's blocks keep their exact gate/up rows resident, so their sketch
    rows are dropped and the memory goes to more slots (numpy reference of the slot count: the
    largest n, one short of every block, whose slots plus the sketch left after dropping the rows
    of n slots' hot set fit); a dropped block scores +inf and is always a candidate, the other
    blocks score as before and get the usual share of candidates, and the op's output is the
    numpy FFN over the kept set."""
    d = smollm2_sketch_dir
    m = mf.load(d)
    rank = np.load(m.resolve(d, m.block_freq_file())).astype(np.float32)
    with _engine(d) as eng:
        full = eng.sketch_scores(3, _inputs(m.n_embd, 1, seed=3)[0])
    sketch = m.sketch.bytes
    L0 = m.layers[0]
    stride, nb, k = L0.block_stride, L0.n_blocks, m.block.k
    total = nb * m.n_layer
    budget = sketch + int(0.4 * total) * stride
    sparsity, f = 0.5, 0.9
    n_cand = int(lib.ls_candidate_blocks(nb, sparsity, 1.5))
    per_block = 2 * skf.row_bytes(m.n_embd) * k
    freed = np.concatenate([[0], np.cumsum(np.full(total, per_block, np.int64))])
    hot_of = lambda n: max(0, min(int(np.floor(f * n)), n - 2 * n_cand))   # noqa: E731
    n = (budget - sketch) // stride
    while n + 1 <= total - 1 and (n + 1) * stride + sketch - freed[hot_of(n + 1)] <= budget:
        n += 1
    n_hot = hot_of(n)
    assert n > (budget - sketch) // stride and n_hot > 0
    with _engine(d, sparsity=sparsity, memory_budget=budget, hot_fraction=f, block_rank=rank) as eng:
        st = eng.stats()
        assert st["cache_capacity"] == n * stride and st["hot_blocks"] == n_hot
        assert st["resident_bytes"] == sketch - n_hot * per_block
        assert st["cache_capacity"] + st["resident_bytes"] <= budget
        want_hot = np.zeros(rank.size, bool)
        want_hot[np.argsort(-rank, axis=None, kind="stable")[:n_hot]] = True
        want_hot = want_hot.reshape(rank.shape)
        il = 3
        x = _inputs(m.n_embd, 1, seed=3)[0]
        sc = eng.sketch_scores(il, x)
        assert np.array_equal(np.isinf(sc), want_hot[il]) and want_hot[il].any()
        np.testing.assert_array_equal(sc[~want_hot[il]], full[~want_hot[il]])
        w = ref.load_layer(m.resolve(d, m.layers[il].file))
        y = eng.eval_layer(il, x[None], n_threads=2, x_res=x)
        cand, kept = eng.last_candidates(il), eng.last_plan(il)
        n_always = int(want_hot[il].sum())
        assert len(cand) == min(nb, n_always + -(-n_cand * (nb - n_always) // nb))
        assert set(np.flatnonzero(want_hot[il])) <= set(cand.tolist())
        assert len(kept) == int(lib.ls_kept_blocks(nb, sparsity))
        xr = ref.round_like_ggml(x, w.gate_type).astype(np.float64)
        hb = np.abs(ref.act(w.gate.astype(np.float64) @ xr, m.activation) * (w.up.astype(np.float64) @ xr))[w.perm]
        rest = np.setdiff1d(cand, kept)
        assert hb[kept].min() >= hb[rest].max() - 1e-3 * hb.max()
        want = ref.ffn_reference(w, x, activation=m.activation, neurons=w.perm[kept])[0]
        np.testing.assert_allclose(y[0], want, rtol=0, atol=2e-3 * float(np.abs(want).max()))


def test_corrupt_or_foreign_sketch_is_refused(smollm2_sketch_dir, tmp_path):
    d = tmp_path / "m.lsm"
    shutil.copytree(smollm2_sketch_dir, d)
    m = mf.load(d)
    p = d / m.sketch_files()[3]
    data = bytearray(p.read_bytes())
    data[5000] ^= 0x10
    p.write_bytes(bytes(data))
    with pytest.raises(LeanstreamError, match="checksum mismatch"):
        _engine(d)
    shutil.copy(d / m.sketch_files()[4], p)                   # another layer's sketch
    with pytest.raises(LeanstreamError, match="does not match layer 3"):
        _engine(d)
    p.write_bytes(bytes(data[:9000]))                         # truncated
    with pytest.raises(LeanstreamError, match="truncated|checksum"):
        _engine(d)


def test_decode_quality_smollm2(smollm2_sketch_dir, smollm2_gguf):
    """Decode-scored (token by token) on held-out text: the default leanstream selection keeps
    SmolLM2's answers (measured x1.06 at s = 0.5 on two windows; the bound leaves noise room)."""
    import llama_cpp

    from leanstream_ggml import Llama
    from leanstream_tools.bench import DEFAULT_TEXT
    from leanstream_tools.perplexity import compare

    text = DEFAULT_TEXT.read_text()
    kw = dict(n_ctx=256, n_batch=256, n_threads=2, logits_all=True, verbose=False)
    llm = Llama(str(smollm2_sketch_dir), mode="leanstream", **kw)
    stock = llama_cpp.Llama(str(smollm2_gguf), **kw)
    try:
        r = compare(llm, stock, text, 256, max_chunks=2, decode=True)
        st = llm.stats()
    finally:
        llm.close()
        stock.close()
    assert r["ppl_ratio"] < 1.15 and r["top1_agreement"] > 0.8, r
    assert st["blocks_candidates"] > 0 and st["down_skipped"] > 0


# ---- quality= ------------------------------------------------------------------------------------

def test_sparsity_for_quality_interpolates_a_monotone_curve():
    from leanstream_ggml.native import params

    table = [{"sparsity": 0.3, "ppl_ratio": 1.01}, {"sparsity": 0.5, "ppl_ratio": 1.05},
             {"sparsity": 0.4, "ppl_ratio": 1.03}, {"sparsity": 0.6, "ppl_ratio": 1.04},   # noise: not monotone
             {"sparsity": 0.7, "ppl_ratio": 1.25}]
    assert params.sparsity_for_quality(table, 1.03) == 0.4
    assert params.sparsity_for_quality(table, 1.04) == 0.45
    assert params.sparsity_for_quality(table, 1.05) == 0.6        # 0.6 is as good as 0.5 after the monotone fix
    assert params.sparsity_for_quality(table, 1.005) == 0.15      # between sparsity 0 (x1) and the first point
    assert params.sparsity_for_quality(table, 2.0) == 0.7
    assert params.quality("ppl+5%") == 1.05 and params.quality(" PPL + 0.5 % ") == 1.005
    for bad in ("5%", "ppl-5%", "ppl+x%", 5, None):
        with pytest.raises(params.ParameterError, match="quality"):
            params.quality(bad)


def test_quality_chooses_the_calibrated_sparsity(smollm2_sketch_dir):
    from leanstream_ggml import Llama
    from leanstream_ggml.native import params

    m = mf.load(smollm2_sketch_dir)
    table = m.sketch.quality
    assert [q["sparsity"] for q in table] == [0.3, 0.4, 0.5, 0.6, 0.7]
    assert all(0.9 < q["ppl_ratio"] < 10 and 0 < q["agreement"] <= 1 for q in table)
    assert table[-1]["ppl_ratio"] > table[0]["ppl_ratio"]       # more sparsity costs more
    llm = Llama(str(smollm2_sketch_dir), quality="ppl+8%", n_ctx=64, verbose=False)
    try:
        assert llm.mode == "leanstream"
        assert llm.sparsity == pytest.approx(params.sparsity_for_quality(table, 1.08), abs=1e-6)
    finally:
        llm.close()
    with pytest.raises(params.ParameterError, match="not both"):
        Llama(str(smollm2_sketch_dir), quality="ppl+8%", sparsity=0.5)
    with pytest.raises(params.ParameterError, match="mode='powerinfer2'"):
        Llama(str(smollm2_sketch_dir), quality="ppl+8%", mode="powerinfer2")
