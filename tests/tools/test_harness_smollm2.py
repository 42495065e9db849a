"""The harness end to end on SmolLM2-135M (slow: each test loads the real model).

The dense-plugin test is the exactness check of docs/design.md §4 in the harness's terms: perplexity of
leanstream dense equals stock's within a stated bound, over the same windows of the bundled text.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
N_CTX = 512
CHUNKS = 2  # 2 windows of 512 tokens, 510 scored positions: under a minute per system on 2 cores

# Bound for "dense equals stock". llama.cpp against itself with another KV-cache precision lands at
# top-1 agreement 0.968-0.973 and mean KL 0.002-0.004 on SmolLM2 (docs/design.md §9). Dense mode adds the
# converter's transposed ffn_down re-quantized to q8_0 (a Q4_1 down cannot be cut per neuron) and
# its own accumulation order; measured: ppl ratio 1.008, agreement 0.963, mean KL 0.006. The bound
# keeps ~2x headroom over that and still fails for any real bug (a wrong block or a dropped
# neuron group moves KL by orders of magnitude).
PPL_RATIO_TOL = 0.02
MIN_AGREEMENT = 0.93
MAX_KL = 0.015


@pytest.fixture(scope="module")
def smollm2():
    from leanstream_ggml.model import registry

    try:
        return registry.fetch("smollm2-135m-instruct", progress=False)
    except RuntimeError as e:
        pytest.skip(f"SmolLM2 not in the cache and not downloadable here: {e}")


@pytest.fixture(scope="module")
def smollm2_dir(smollm2, tmp_path_factory):
    import leanstream_convert

    out = tmp_path_factory.mktemp("lsm") / "smollm2.lsm"
    leanstream_convert.convert(smollm2, out, progress=False, sketch="none")
    return out


@pytest.fixture(scope="module")
def text():
    from leanstream_tools.bench import DEFAULT_TEXT

    return DEFAULT_TEXT.read_text(encoding="utf-8")


def _open(path, system):
    from leanstream_tools import systems

    return systems.open_model(path, system, n_ctx=N_CTX, n_threads=2, n_batch=N_CTX, logits_all=True)


def test_bench_cli_prints_one_json_document(smollm2):
    r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "bench", str(smollm2), "--json",
                        "-p", "16", "-n", "4", "-r", "2", "-t", "2"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert d["system"] == "stock" and d["stock"].startswith("llama-cpp-python 0.3.36")
    assert d["n_prompt"] == 16 and d["n_gen"] == 4 and len(d["repetitions"]) == 2
    assert d["prefill_tok_s"] > 0 and d["decode_tok_s"] > 0
    assert d["peak_rss_bytes"] >= d["rss_after_load_bytes"] > 0
    assert len(d["generated"]) == 4
    assert d["engine_total"] == {}  # stock has no engine counters


def test_perplexity_is_deterministic_against_itself(smollm2, text):
    from leanstream_tools import perplexity

    r = perplexity.compare(_open(smollm2, "stock"), _open(smollm2, "stock"), text, N_CTX, max_chunks=1)
    assert r["n_scored"] == N_CTX // 2 - 1
    assert r["top1_agreement"] == 1.0
    assert r["kl_mean"] < 1e-9 and r["ppl_ratio"] == pytest.approx(1.0, abs=1e-9)
    assert 5 < r["ppl"] < 200  # a 135M model on English technical prose


def test_dense_plugin_perplexity_matches_stock(smollm2, smollm2_dir, text):
    """Needs the plugin (leanstream_ggml/llama.py + libleanstream): an ImportError here means the
    plugin is missing or not built, which is a failure, not a skip."""
    from leanstream_tools import perplexity

    dense = _open(smollm2_dir, "leanstream")
    r = perplexity.compare(dense, _open(smollm2, "stock"), text, N_CTX, max_chunks=CHUNKS)
    msg = (f"ppl dense {r['ppl']:.4f} vs stock {r['ppl_reference']:.4f} (ratio {r['ppl_ratio']:.4f}), "
           f"agreement {r['top1_agreement']:.4f}, mean KL {r['kl_mean']:.5f}")
    print(msg)
    assert abs(r["ppl_ratio"] - 1) <= PPL_RATIO_TOL, msg
    assert r["top1_agreement"] >= MIN_AGREEMENT, msg
    assert r["kl_mean"] <= MAX_KL, msg


def test_side_by_side_runner_json_and_plot(smollm2, smollm2_dir, tmp_path):
    pytest.importorskip("matplotlib", reason="the runner's plot needs matplotlib (pip install matplotlib)")
    out, png = tmp_path / "sbs.json", tmp_path / "sbs.png"
    r = subprocess.run([sys.executable, "bench/side_by_side.py", "--model", str(smollm2),
                        "--model-dir", str(smollm2_dir), "--systems", "stock,dense", "--limits", "none,400MB",
                        "-p", "8", "-n", "4", "-r", "1", "-t", "2", "--timeout", "240",
                        "--out", str(out), "--plot", str(png)],
                       capture_output=True, text=True, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc == json.loads(out.read_text())
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert [(e["system"], e["limit_bytes"]) for e in doc["runs"]] == \
        [("stock", None), ("dense", None), ("stock", 400 * 10**6), ("dense", 400 * 10**6)]
    for e in doc["runs"]:
        assert e["status"] == "ok", e
        assert e["result"]["decode_tok_s"] > 0
    if doc["cgroup"]["writable"]:
        limited = [e for e in doc["runs"] if e["limit_bytes"]]
        assert all(e["cgroup"]["max_usage_bytes"] <= 400 * 10**6 for e in limited)
        dense = next(e for e in limited if e["system"] == "dense")
        assert dense["memory_budget_bytes"] == 400 * 10**6 - dense["plugin_reserve_bytes"]
    # the runner's correctness check is computed; dense agrees with stock on ~96 % of top-1 choices
    # (see the perplexity test), so a greedy continuation may part after a near-tie: require only
    # that the first token after the prompt is the same
    m = next(e for e in doc["runs"] if e["system"] == "dense")["greedy_match_vs_stock"]
    assert 0 < m <= 1


def test_sparse_mode_perplexity_is_scored_token_by_token(smollm2, smollm2_dir, text, tmp_path):
    """A sparse mode is sparse only for one-token batches (generation); prefill is dense. So its
    perplexity must be scored while decoding: batch-scored it would show dense quality. With random
    (untrained) predictors at sparsity 0.5 the decode-scored perplexity is clearly worse than the
    batch-scored one, which stays at the dense level."""
    pytest.importorskip("torch", reason="predictor files are made with torch (convert extra)")
    import shutil

    from pred_synth import write_random_predictors

    from leanstream_tools import perplexity, systems

    d = tmp_path / "smollm2.lsm"
    shutil.copytree(smollm2_dir, d)
    write_random_predictors(d)
    n_ctx = 128
    kw = dict(n_ctx=n_ctx, n_threads=2, n_batch=n_ctx, logits_all=True)
    sparse = systems.open_model(d, "leanstream", mode="leanstream", extra={"sparsity": 0.5}, **kw)
    stock = systems.open_model(smollm2, "stock", **kw)
    batch = perplexity.compare(sparse, stock, text, n_ctx, max_chunks=1)
    decoded = perplexity.compare(sparse, stock, text, n_ctx, max_chunks=1, decode=True)
    msg = f"batch-scored ratio {batch['ppl_ratio']:.3f}, decode-scored {decoded['ppl_ratio']:.3f}"
    assert abs(batch["ppl_ratio"] - 1) <= 0.05, msg
    assert decoded["ppl_ratio"] > 1.2 and decoded["kl_mean"] > 5 * batch["kl_mean"], msg

    r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "perplexity", str(d), "--mode", "leanstream",
                        "--sparsity", "0.5", "-c", str(n_ctx), "--chunks", "1", "-t", "2",
                        "--json"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["decode_scored"] is True and out["sparsity"] == 0.5
    assert out["ppl"] > 1.2 * decoded["ppl_reference"]   # sparse there too


def test_smaller_quant_made_with_llamas_quantizer(smollm2, tmp_path):
    """A stock user's alternative at a memory limit: a smaller quantization of the same model,
    made by llama.cpp's own llama_model_quantize (bound by llama-cpp-python), once."""
    import shutil

    import llama_cpp

    from leanstream_tools import perplexity, quants

    src = tmp_path / smollm2.name
    shutil.copyfile(smollm2, src)
    out = quants.requantize(src, "Q2_K", n_threads=2)
    assert out == tmp_path / "SmolLM2-135M-Instruct.Q2_K-from-Q4_1.gguf"
    assert 0 < out.stat().st_size < src.stat().st_size
    mtime = out.stat().st_mtime_ns
    assert quants.requantize(src, "Q2_K") == out and out.stat().st_mtime_ns == mtime   # reused
    assert not list(tmp_path.glob("*.partial"))
    text = (REPO / "leanstream_tools/data/heldout-technical.txt").read_text()
    kw = dict(n_ctx=128, n_threads=2, n_batch=128, logits_all=True, verbose=False)
    small, ref = llama_cpp.Llama(str(out), **kw), llama_cpp.Llama(str(src), **kw)
    try:
        assert small.metadata.get("general.file_type") == str(quants.FTYPES["Q2_K"])
        r = perplexity.compare(small, ref, text, 128, max_chunks=1)
    finally:
        small.close()
        ref.close()
    # a real, usable but worse model: 2-bit weights cost perplexity
    assert 1.0 < r["ppl_ratio"] < 10, r
    with pytest.raises(ValueError, match="unknown quantization"):
        quants.requantize(src, "Q1_X")
