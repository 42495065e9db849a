"""C predictor latency per call (pytest-benchmark): one layer, one refinement step.

Random weights of the exported shapes (latency does not depend on the values):
SmolLM2-135M (576 -> 1536 blocks) and Qwen2.5-1.5B (1536 -> 8960), the trained config
(L=3, tau=6, d=256, M=4) and the paper's (L=5, tau=8, d=256, M=1).
    pytest tests/bench/test_predictor_bench.py --benchmark-only
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pytest_benchmark")
torch = pytest.importorskip("torch")

from leanstream_convert.train import export as E  # noqa: E402
from leanstream_convert.train import hashing as H  # noqa: E402

SHAPES = {"smollm2": (576, 1536), "qwen2.5-1.5b": (1536, 8960)}
CONFIGS = {"trained": dict(n_hash_layers=3, tau=6, n_bits=256, n_tables=4),
           "paper": dict(n_hash_layers=5, tau=8, n_bits=256, n_tables=1)}


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("model", list(SHAPES))
def test_predictor_latency(benchmark, model, cfg_name):
    try:
        from leanstream_ggml.native._native import ffi
        from leanstream_convert.train.export import NativePredictor
    except ImportError as e:
        pytest.skip(f"libleanstream not available: {e}")
    n_embd, n_blocks = SHAPES[model]
    cfg = H.HashConfig(**CONFIGS[cfg_name])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, n_embd)).astype(np.float32)
    mean, scale = H.input_stats(x)
    torch.manual_seed(0)
    m = H.HashingPredictor(n_embd, n_blocks, cfg, mean, scale, H.fit_pca((x - mean) * scale, cfg.pca_frac))
    data = E.serialize(m.export_params(), tau=cfg.tau, n_tables=cfg.n_tables)
    with NativePredictor(data) as c:
        assert np.array_equal(c(x[:4]), m.infer(x[:4]).numpy())     # correct before timed
        xp = ffi.new("float[]", x[0].tolist())
        yp = ffi.new("float[]", n_blocks)
        benchmark.extra_info["bytes"] = len(data)
        rc = benchmark(c.eval_into, xp, yp)
        assert rc == 0
