"""FFN kernel throughput (pytest-benchmark): GB/s of weight bytes streamed by the dense op, against a
plain memory read of as many bytes on the same machine (bench/memory_read.py: AVX2 loads, same threads).

One timed round is one decode token through every layer (T = 1, 2 threads, everything resident,
the layers together larger than the last-level cache), so the weights come from RAM as in decode:
- "qwen2.5-shape": three layers of Qwen2.5-1.5B's shape (1536 -> 8960), Q4_K gate/up rows and
  Q8_0 down columns as the converter writes them from a Q4_K_M GGUF (random weights: the kernels'
  speed does not depend on the values);
- "smollm2": the real SmolLM2-135M (Q4_1 gate/up), all 30 layers.

A verify pass (``test_verify_pass_*``): the same layers on T = 2, 5, 17 token rows at once, each
row bit for bit the one-token op's (checked before timing); extra_info carries the one-row pass
measured in the same test and the ms each extra row adds ((t(T) - t(1)) / (T - 1)).
bench/resident_speed.py --op-rows measures the whole of a real model per row count.

    pytest tests/bench/test_kernel_bench.py --benchmark-only [--benchmark-json out.json]

extra_info carries weight_gb_s, memory_read_gb_s and their ratio; nothing here asserts a speed.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

import bench_modules

pytest.importorskip("pytest_benchmark")

from leanstream_convert import convert  # noqa: E402
from gguf_synth import write_tiny_model  # noqa: E402
from leanstream_ggml.model import manifest as mf  # noqa: E402
from leanstream_ggml.native._native import ffi, lib  # noqa: E402
from leanstream_ggml.native.engine import FFNEngine  # noqa: E402
from reference import ffn_reference, load_layer  # noqa: E402

N_THREADS = 2


@pytest.fixture(scope="module")
def qwen_shape(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen-shape")
    write_tiny_model(d / "m.gguf", arch="qwen2", n_layer=3, n_embd=1536, n_ff=8960, n_head=12, n_head_kv=2,
                     types={"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, seed=3)
    m = convert(d / "m.gguf", d / "lsm", progress=False, sketch="none")
    return [m.layer_path(d / "lsm", il) for il in range(3)]


def _memory_read_gb_s(n_bytes: int, rounds: int = 7) -> float:
    return bench_modules.load("memory_read").measure(n_bytes, N_THREADS, rounds)["gb_s"]


def _bench(benchmark, paths):
    with FFNEngine(paths, mode="dense") as e:
        n_embd = e.layer_info(0)["n_embd"]
        x = np.random.default_rng(0).standard_normal((1, n_embd)).astype(np.float32)
        n_bytes = sum(e.layer_info(il)["block_payload"] * e.layer_info(il)["n_blocks"] for il in range(len(paths)))
        ys = [e.eval_layer(il, x, N_THREADS) for il in range(len(paths))]   # loads every block
        w = load_layer(paths[0])
        want = ffn_reference(w, x)   # correct before timed
        assert np.abs(ys[0] - want).max() <= 5e-3 * np.abs(want).max() + 1e-5

        assert np.array_equal(e.eval_layers(0, len(paths), x, N_THREADS), ys[-1])

        def one_token():
            e.eval_layers(0, len(paths), x, N_THREADS)

        benchmark.pedantic(one_token, rounds=15, warmup_rounds=2)
    kernel = n_bytes / benchmark.stats.stats.median / 1e9
    base = _memory_read_gb_s(n_bytes)
    assert n_bytes > 0 and kernel > 0 and base > 0
    benchmark.extra_info.update({"weight_bytes": n_bytes, "weight_gb_s": round(kernel, 2),
                                 "memory_read_gb_s": round(base, 2), "ratio": round(kernel / base, 3),
                                 "isa": ffi.string(lib.ls_kernel_isa()).decode(), "threads": N_THREADS})
    print(f"\n{benchmark.name}: {kernel:.1f} GB/s of weights, memory read {base:.1f} GB/s, ratio {kernel / base:.2f}")


def test_kernel_gb_s_qwen_shape(benchmark, qwen_shape):
    _bench(benchmark, qwen_shape)


def test_kernel_gb_s_smollm2(benchmark, smollm2_dir):
    m = mf.load(smollm2_dir)
    _bench(benchmark, [m.resolve(smollm2_dir, L.file) for L in m.layers])


def _bench_rows(benchmark, paths, n_rows):
    with FFNEngine(paths, mode="dense") as e:
        n_embd, n = e.layer_info(0)["n_embd"], len(paths)
        x = np.random.default_rng(1).standard_normal((n_rows, n_embd)).astype(np.float32)
        y = e.eval_layers(0, n, x, N_THREADS)   # loads every block
        for t in range(n_rows):   # correct before timed: each row as that token alone
            assert np.array_equal(y[t], e.eval_layers(0, n, x[t:t + 1], N_THREADS)[0])
        one = []
        for _ in range(9):
            t0 = time.perf_counter()
            e.eval_layers(0, n, x[:1], N_THREADS)
            one.append(time.perf_counter() - t0)

        def verify_pass():
            e.eval_layers(0, n, x, N_THREADS)

        benchmark.pedantic(verify_pass, rounds=15, warmup_rounds=2)
    t1, tt = statistics.median(one) * 1e3, benchmark.stats.stats.median * 1e3
    benchmark.extra_info.update({"rows": n_rows, "one_row_ms": round(t1, 2), "pass_ms": round(tt, 2),
                                 "extra_row_ms": round((tt - t1) / (n_rows - 1), 2),
                                 "isa": ffi.string(lib.ls_kernel_isa()).decode(), "threads": N_THREADS})
    print(f"\n{benchmark.name}: {tt:.1f} ms for {n_rows} rows, {t1:.1f} ms for one: "
          f"{(tt - t1) / (n_rows - 1):.2f} ms per extra row")


@pytest.mark.parametrize("n_rows", [2, 5, 17])
def test_verify_pass_qwen_shape(benchmark, qwen_shape, n_rows):
    _bench_rows(benchmark, qwen_shape, n_rows)


@pytest.mark.parametrize("n_rows", [2, 5, 17])
def test_verify_pass_smollm2(benchmark, smollm2_dir, n_rows):
    m = mf.load(smollm2_dir)
    _bench_rows(benchmark, [m.resolve(smollm2_dir, L.file) for L in m.layers], n_rows)
