"""Stacked learnable hashing predictor training (torch): C == torch == numpy inference, training,
profiling. The file format and its malformed-file tests need no torch: test_predictor_file.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="predictor training needs torch (pip install .[train])")
torch.set_num_threads(2)

from leanstream_convert.train import export as E  # noqa: E402
from leanstream_convert.train import hashing as H  # noqa: E402
from leanstream_convert.train import metrics as M  # noqa: E402


def _native():
    try:
        from leanstream_convert.train.export import NativePredictor
        from leanstream_ggml.native import _native  # noqa: F401
    except ImportError as e:  # library not built
        pytest.skip(f"libleanstream not available: {e}")
    return NativePredictor


def _random_model(n_embd, n_blocks, cfg, seed=0, n_fit=200):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n_fit, n_embd)) * rng.uniform(0.1, 5, n_embd) + rng.normal(0, 2, n_embd)).astype(np.float32)
    mean, scale = H.input_stats(x)
    pca = H.fit_pca((x - mean) * scale, cfg.pca_frac)
    torch.manual_seed(seed)
    m = H.HashingPredictor(n_embd, n_blocks, cfg, mean, scale, pca)
    with torch.no_grad():   # non-trivial thresholds / biases so every code path matters
        for layer in m.layers[1:]:
            layer.b.normal_(0, 4)
        m.layers[0].b.normal_(0, 1)
        m.head_c.normal_()
        m.head_a.uniform_(-0.5, 0.5)
    return m, x


CONFIGS = [
    H.HashConfig(n_hash_layers=1, tau=1, n_bits=64, n_tables=1, pca_frac=0.3),
    H.HashConfig(n_hash_layers=3, tau=5, n_bits=128, n_tables=3, pca_frac=0.3),
    H.HashConfig(n_hash_layers=5, tau=8, n_bits=256, n_tables=1, pca_frac=0.3),   # the paper's default
    H.HashConfig(n_hash_layers=3, tau=6, n_bits=128, n_tables=4, skip_weight=5, pca_frac=0.3),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"L{c.n_hash_layers}t{c.tau}d{c.n_bits}M{c.n_tables}")
def test_c_equals_torch_random(cfg):
    NativePredictor = _native()
    m, x = _random_model(72, 50, cfg)
    rng = np.random.default_rng(1)
    xs = np.concatenate([x[:50], rng.standard_normal((50, 72)).astype(np.float32) * 100,
                         np.zeros((1, 72), np.float32), np.full((1, 72), 1e-30, np.float32)])
    ref = m.infer(xs).numpy()
    with NativePredictor(E.serialize(m.export_params(), tau=cfg.tau, n_tables=cfg.n_tables)) as c:
        out = c(xs)
        one = c(xs[3])
    assert out.dtype == np.float32 and out.shape == ref.shape
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
    assert np.array_equal(one.view(np.uint32), ref[3].view(np.uint32))
    # the runtime's numpy reference (what the torch-free tests compare the C to) is the same function
    from reference import reference_eval
    num = reference_eval(m.export_params(), xs, tau=cfg.tau, n_tables=cfg.n_tables)
    assert np.array_equal(num.view(np.uint32), ref.view(np.uint32))


def test_export_matches_the_trained_model(tmp_path):
    """What torch trained is what the file holds (the file format itself: test_predictor_file.py)."""
    cfg = CONFIGS[1]
    m, x = _random_model(40, 33, cfg, seed=3)
    params = m.export_params()
    path = tmp_path / "blk.7.lspred"
    E.write_predictor(path, params, tau=cfg.tau, n_tables=cfg.n_tables, layer=7)
    _, back = E.read_predictor(path)
    assert np.array_equal(H.infer_params(back, cfg.tau, cfg.n_tables, x).numpy(), m.infer(x).numpy())
    assert np.array_equal(H.unpack_signs(params["head_w"], 128),
                          np.where(m.head_w.detach().numpy() >= 0, 1.0, -1.0))


def test_training_beats_chance():
    """Known structure: inputs come from 8 clusters, each with its own set of important blocks."""
    rng = np.random.default_rng(0)
    n, d, b, k = 3000, 48, 40, 8
    centers = rng.standard_normal((k, d)).astype(np.float32) * 3
    hot = rng.random((k, b)) < 0.15
    c = rng.integers(0, k, n)
    x = centers[c] + rng.standard_normal((n, d)).astype(np.float32)
    imp = np.abs(rng.standard_normal((n, b))).astype(np.float32) * 0.2 + hot[c] * rng.uniform(1, 2, (n, b)).astype(np.float32)
    cfg = H.HashConfig(n_hash_layers=2, tau=4, n_bits=64, n_tables=2, pca_frac=0.5, steps=120, batch=128, lr=0.05)
    mean, scale = H.input_stats(x[:2500])
    model = H.HashingPredictor(d, b, cfg, mean, scale, H.fit_pca((x[:2500] - mean) * scale, cfg.pca_frac))
    losses = H.train_model(model, x[:2500], imp[:2500], steps=cfg.steps, batch=cfg.batch, lr=cfg.lr)
    assert np.mean(losses[-15:]) < 0.85 * np.mean(losses[:5])
    prio = model.infer(x[2500:]).numpy()
    rec = M.top_recall(prio, imp[2500:], 0.8)
    chance = M.top_recall(rng.random((500, b)), imp[2500:], 0.8)
    assert chance < 0.3 and rec > 0.7, (rec, chance)
    assert M.importance_ratio(prio, imp[2500:], 0.8) > M.importance_ratio(rng.random((500, b)), imp[2500:], 0.8) + 0.2


def test_metrics_and_blocks():
    imp = np.array([[4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    assert M.importance_ratio(imp, imp, 0.9) == pytest.approx(0.4)
    assert M.top_recall(imp, imp, 0.9) == 1.0
    assert M.top_recall(-imp, imp, 0.5) == 0.0
    a = np.arange(12, dtype=np.float32)[None]
    perm = np.array([5, 0, 11, 3, 7, -1] + list(range(0)))   # k = 2: blocks (5,0), (11,3), (7,pad)
    assert M.block_importance(a, perm[:6], 2).tolist() == [[5.0, 14.0, 7.0]]
    nm = M.neuron_mask_of_blocks(np.array([[False, True, False]]), perm[:6], 12, 2)
    assert np.flatnonzero(nm[0]).tolist() == [3, 11]


def test_refined_inputs_eq2():
    from leanstream_convert.train.pipeline import refined_inputs

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5))
    a = rng.standard_normal((3, 16))
    w = rng.standard_normal((5, 16))
    prio = rng.random((3, 16))
    s = np.array([0.5, 0.5, 0.0])
    j = np.array([0, 4, 8])
    out = refined_inputs(x, a, w, prio, s, j)
    assert np.allclose(out[0], x[0])
    first = np.argsort(-prio[1])[:4]          # 8 selected blocks, 4 of 8 stages -> the top 4
    assert np.allclose(out[1], x[1] + w[:, first] @ a[1, first])
    assert np.allclose(out[2], x[2] + w @ a[2])   # s = 0, all stages: the dense FFN output


# ---- profiling on a tiny synthetic GGUF ---------------------------------------------------

def _tiny(tmp_path):
    pytest.importorskip("llama_cpp")
    gs = pytest.importorskip("gguf_synth")
    path = tmp_path / "tiny.gguf"
    w = gs.write_tiny_model(path, arch="llama", n_layer=2, n_embd=64, n_ff=96,
                            types={"ffn": "F32", "attn": "F32", "embd": "F32", "output": "F32"}, seed=0)
    return path, w


def test_profile_matches_numpy(tmp_path):
    from leanstream_convert.profile import ProfileData, Profiler, profile_model

    path, w = _tiny(tmp_path)
    with Profiler(path, n_ctx=64, n_threads=1) as prof:
        toks = prof.tokenize("hello world, this is a tiny test of profiling")
        got = prof.run(toks)
    for il in range(2):
        x = got[("ffn_inp", il)]
        xn = got[("ffn_norm", il)]
        a = got[("ffn_swiglu", il)]
        assert x.shape == (len(toks), 64) and a.shape == (len(toks), 96)
        ref_xn = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-5) * w[f"blk.{il}.ffn_norm.weight"]
        assert np.allclose(xn, ref_xn, rtol=1e-4, atol=1e-5)
        g = xn.astype(np.float64) @ w[f"blk.{il}.ffn_gate.weight"].T
        u = xn.astype(np.float64) @ w[f"blk.{il}.ffn_up.weight"].T
        ref_a = g / (1 + np.exp(-g)) * u
        assert np.allclose(a, ref_a, rtol=1e-3, atol=1e-4 * np.abs(ref_a).max())

    # the on-disk profile (--calibration text) equals the same computation, and reruns resume
    text = tmp_path / "calib.txt"
    text.write_text("hello world, this is a tiny test of profiling. " * 6)
    meta = profile_model(path, tmp_path / "prof", calibration=text, n_ctx=64, chunk_tokens=40,
                         n_threads=1, progress=False, log=lambda *a: None)
    data = ProfileData(tmp_path / "prof")
    assert data.n_layer == 2 and data.n_ff == 96 and data.n_tokens == sum(meta["tokens"]) > 0
    x1, a1 = data.layer("x", 1), data.layer("a", 1)
    assert x1.shape == (data.n_tokens, 64) and a1.shape == (data.n_tokens, 96)
    with Profiler(path, n_ctx=64, n_threads=1) as prof:
        seq = prof.tokenize(text.read_text())[:64]
        direct = prof.run(seq)[("ffn_swiglu", 1)][16:]
    assert np.allclose(a1[:len(direct)], direct, rtol=2e-3, atol=2e-3 * np.abs(direct).max())
    meta2 = profile_model(path, tmp_path / "prof", calibration=text, n_ctx=64, chunk_tokens=40,
                          n_threads=1, progress=False, log=lambda *a: None)
    assert meta2["chunks"] == meta["chunks"]


def test_pipeline_tiny_c_equals_torch_on_real_inputs(tmp_path):
    """Profile -> train -> export on the tiny model; C == torch on its real activations."""
    NativePredictor = _native()
    from leanstream_convert.train.pipeline import predictor_path, train_from_profile
    from leanstream_convert.profile import ProfileData, profile_model

    path, _ = _tiny(tmp_path)
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog while profiling runs. " * 12)
    profile_model(path, tmp_path / "prof", calibration=text, n_ctx=128, n_threads=1, progress=False,
                  log=lambda *a: None)
    cfg = H.HashConfig(n_hash_layers=2, tau=4, n_bits=64, n_tables=2, steps=10, batch=32)
    s = train_from_profile(tmp_path / "prof", path, tmp_path / "model", cfg=cfg, train_mlp=True, mlp_steps=10,
                           eval_tokens=32, log=lambda *a: None)
    assert len(s["files"]) == 2 and s["bytes"] > 0
    assert set(s["refinement"]) == {"hashing", "mlp", "oracle"}
    x = ProfileData(tmp_path / "prof").layer("x", 0)
    hdr, params = E.read_predictor(predictor_path(tmp_path / "model", 1))
    ref = H.infer_params(params, hdr["tau"], hdr["n_tables"], x).numpy()
    with NativePredictor(predictor_path(tmp_path / "model", 1)) as c:
        assert np.array_equal(c(x).view(np.uint32), ref.view(np.uint32))


def test_profile_and_train_stages_quick_default_calibration(tmp_path):
    """The converter's profile and train stages, with the default calibration (the model's own
    answers): the profile into the state folder, one predictor file per layer, their summary."""
    _native()
    from leanstream_convert.train.pipeline import predictor_info, profile_for_training, train_predictors

    path, _ = _tiny(tmp_path)
    cfg = H.HashConfig(n_hash_layers=2, tau=4, n_bits=64, n_tables=2, steps=5, batch=32)
    state = tmp_path / "model" / ".convert"
    state.mkdir(parents=True)
    prof = profile_for_training(path, state / "profile", quick=True, progress=False,
                                profile_kwargs=dict(n_prompts=2, max_tokens=24), log=lambda *a: None)
    assert prof["profile"] == str(state / "profile") and prof["seconds"] >= 0
    res = train_predictors(state / "profile", path, tmp_path / "model", state_dir=state, quick=True, cfg=cfg,
                           profile_seconds=prof["seconds"], log=lambda *a: None)
    entry = predictor_info(tmp_path / "model")
    assert entry.format == "lspred" and entry.version == E.FILE_VERSION
    assert res["files"] == entry.files == ["predictor/blk.0.lspred", "predictor/blk.1.lspred"]
    assert all((tmp_path / "model" / f).exists() for f in entry.files)   # the profile is removed after training
