"""Predictor files without torch: the C evaluator equals the numpy reference bit for bit, and
malformed files are refused by both readers. (tests/native/test_predictor.py ties the torch training
path to the same reference.)"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from leanstream_convert.train import export as E
from leanstream_convert.train.export import NativePredictor
from leanstream_ggml.native._native import LeanstreamError, ffi, lib
from reference import reference_eval


def random_params(n_embd, n_blocks, *, L, tau, n_bits, M, skip=None, n_pca=None, seed=0) -> dict:
    """Random but well-formed exported parameters: every code path of the evaluator matters
    (thresholds near the popdot range, biases of both signs)."""
    rng = np.random.default_rng(seed)
    n_pca = n_pca or max(1, n_embd // 3)
    w, mt, kk = n_bits // 64, M * tau, 1 << tau
    u64 = lambda *shape: rng.integers(0, 2**63, size=shape, dtype=np.uint64) * 2 + rng.integers(0, 2, size=shape, dtype=np.uint64)  # noqa: E731
    return {
        "in_mean": rng.normal(0, 2, n_embd).astype(np.float32),
        "in_scale": rng.uniform(0.1, 3, n_embd).astype(np.float32),
        "pca_q": rng.integers(-127, 128, (n_pca, n_embd), dtype=np.int8),
        "pca_scale": rng.uniform(1e-3, 1e-2, n_pca).astype(np.float32),
        "hp1_q": rng.integers(-127, 128, (mt, n_pca), dtype=np.int8),
        "hp1_scale": rng.uniform(1e-3, 1e-1, mt).astype(np.float32),
        "hp1_bias": rng.normal(0, 1, mt).astype(np.float32),
        "tables": [u64(M * kk, w) for _ in range(L)],
        "hp": [u64(mt, w) for _ in range(L - 1)],
        "thr": [rng.integers(-n_bits // 4, n_bits // 4, mt).astype(np.int32) for _ in range(L - 1)],
        "head_w": u64(n_blocks, w),
        "head_a": rng.uniform(-0.5, 0.5, n_blocks).astype(np.float32),
        "head_c": rng.normal(0, 1, n_blocks).astype(np.float32),
        "skip_weight": max(1, M - 1) if skip is None else skip,
    }


CONFIGS = [dict(L=1, tau=1, n_bits=64, M=1), dict(L=3, tau=5, n_bits=128, M=3),
           dict(L=5, tau=8, n_bits=256, M=1), dict(L=3, tau=6, n_bits=128, M=4, skip=5)]


def _inputs(n_embd, seed=1):
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.standard_normal((60, n_embd)).astype(np.float32) * rng.uniform(0.1, 5, n_embd),
                           rng.standard_normal((20, n_embd)).astype(np.float32) * 100,
                           np.zeros((1, n_embd), np.float32), np.full((1, n_embd), 1e-30, np.float32)])


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "L{L}t{tau}d{n_bits}M{M}".format(**c))
def test_c_equals_numpy_reference(cfg):
    params = random_params(72, 50, **cfg)
    x = _inputs(72)
    ref = reference_eval(params, x, tau=cfg["tau"], n_tables=cfg["M"])
    assert ref.dtype == np.float32 and ref.shape == (len(x), 50)
    assert len(np.unique(ref.round(4))) > 10      # not a degenerate predictor
    with NativePredictor(E.serialize(params, tau=cfg["tau"], n_tables=cfg["M"])) as c:
        assert np.array_equal(c(x).view(np.uint32), ref.view(np.uint32))
        assert np.array_equal(c(x[3]).view(np.uint32), ref[3].view(np.uint32))


def test_round_trip_and_version_1(tmp_path):
    cfg = CONFIGS[1]
    params = random_params(40, 33, **cfg, seed=3)
    path = tmp_path / "blk.7.lspred"
    size = E.write_predictor(path, params, tau=cfg["tau"], n_tables=cfg["M"], layer=7)
    assert path.stat().st_size == size and size % 64 == 0
    hdr, back = E.read_predictor(path)
    assert hdr["layer"] == 7 and hdr["n_blocks"] == 33 and hdr["n_bits"] == 128 and hdr["version"] == E.FILE_VERSION
    for key in ("in_mean", "pca_q", "hp1_bias", "head_w", "head_c"):
        assert np.array_equal(back[key], params[key])
    for a, b in zip(back["tables"] + back["hp"] + back["thr"], params["tables"] + params["hp"] + params["thr"]):
        assert np.array_equal(a, b)
    x = _inputs(40)
    with NativePredictor(path) as c:
        assert c.info["layer"] == 7 and c.info["size_bytes"] == size
        assert np.array_equal(c(x), reference_eval(back, x, tau=cfg["tau"], n_tables=cfg["M"]))
    # version 1 files (before the skip weight existed) are read with one skip vote
    data = path.read_bytes()
    v1 = data[:8] + struct.pack("<I", 1) + data[12:60] + b"\0" * 4 + data[64:]
    hdr1, back1 = E.parse(v1)
    assert hdr1["version"] == 1 and back1["skip_weight"] == 1
    ref1 = reference_eval(back1, x, tau=cfg["tau"], n_tables=cfg["M"])
    assert not np.array_equal(ref1, reference_eval(back, x, tau=cfg["tau"], n_tables=cfg["M"]))
    with NativePredictor(v1) as c:
        assert np.array_equal(c(x).view(np.uint32), ref1.view(np.uint32))


def _bad_files(data: bytes):
    yield "empty", b""
    yield "header only", data[:100]
    yield "truncated payload", data[:-64]
    yield "one byte short", data[:-1]
    yield "padded", data + b"\0" * 64
    yield "bad magic", b"XXXXXXXX" + data[8:]
    yield "version 3", data[:8] + struct.pack("<I", 3) + data[12:]
    yield "skip weight 0", data[:60] + struct.pack("<I", 0) + data[64:]
    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 0x40
    yield "corrupted payload", bytes(corrupt)
    huge = bytearray(data)
    huge[20:24] = struct.pack("<I", 1 << 30)   # n_blocks out of range
    yield "bad dimension", bytes(huge)


def test_bad_files_rejected(tmp_path):
    data = E.serialize(random_params(16, 8, **CONFIGS[0]), tau=1, n_tables=1)
    for what, bad in _bad_files(data):
        with pytest.raises(E.PredictorFormatError):
            E.parse(bad)
        with pytest.raises(LeanstreamError) as ei:
            NativePredictor(bad)
        assert ei.value.status == lib.LS_ERR_FORMAT, what
        assert "predictor" in str(ei.value), what
    (tmp_path / "v3.lspred").write_bytes(data[:8] + struct.pack("<I", 3) + data[12:])
    with pytest.raises(LeanstreamError, match="version 3"):
        NativePredictor(tmp_path / "v3.lspred")
    with pytest.raises(LeanstreamError) as ei:
        NativePredictor(tmp_path / "missing.lspred")
    assert ei.value.status == lib.LS_ERR_IO
    with NativePredictor(data) as c:   # wrong output size is an argument error, not a crash
        x = ffi.new("float[]", 16)
        y = ffi.new("float[]", 9)
        assert lib.ls_predictor_eval(c._h, x, y, 9) == lib.LS_ERR_ARG
