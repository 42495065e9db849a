"""Sketch scorer throughput (pytest-benchmark): one layer of the real SmolLM2 sketch scored on
one thread (ls_engine_sketch_scores, what each ggml thread runs on its share), against a plain
read of the same number of bytes with numpy on the same machine.
    pytest tests/bench/test_sketch_bench.py --benchmark-only
"""

from __future__ import annotations

import functools
import operator

import numpy as np
import pytest

pytest.importorskip("pytest_benchmark")


def test_sketch_scorer_layer(benchmark, smollm2_sketch_dir):
    from leanstream_ggml.model import manifest as mf
    from leanstream_ggml.native.engine import FFNEngine

    d = smollm2_sketch_dir
    m = mf.load(d)
    with FFNEngine([m.resolve(d, e.file) for e in m.layers], mode="leanstream",
                   sketch_paths=[m.resolve(d, f) for f in m.sketch_files()]) as eng:
        x = np.random.default_rng(0).standard_normal(m.n_embd).astype(np.float32)
        out = benchmark(eng.sketch_scores, 7, x)
    assert out.shape == (m.layers[7].n_blocks,) and np.all(out >= 0)
    layer_bytes = m.sketch.bytes / m.n_layer
    benchmark.extra_info["sketch_bytes_per_layer"] = layer_bytes
    benchmark.extra_info["GB_per_s"] = layer_bytes / benchmark.stats.stats.median / 1e9


def test_memory_read_baseline(benchmark, smollm2_sketch_dir):
    from leanstream_ggml.model import manifest as mf

    m = mf.load(smollm2_sketch_dir)
    n = int(m.sketch.bytes / m.n_layer) // 8
    a = np.random.default_rng(0).integers(0, 1 << 60, n, dtype=np.uint64)
    folded = benchmark(np.bitwise_xor.reduce, a)
    # it read every word: the fold equals one over the same words taken another way (Python ints)
    assert n > 0 and int(folded) == functools.reduce(operator.xor, a.tolist())
    gb_s = 8 * n / benchmark.stats.stats.median / 1e9
    assert gb_s > 0
    benchmark.extra_info["GB_per_s"] = gb_s
