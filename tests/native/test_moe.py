"""The native MoE op (native/src/moe.c; its experts read by the blocks' one reader, io.c: its injected
faults are test_reader.py's) over expert files written by the converter
(leanstream_convert/experts.py), against the numpy reference (tests/support/reference.py: moe_reference).

Error bound: the reference rounds x and h the way ggml rounds a matmul's activations (the weight
type's vec_dot_type, gguf-py's dequantization of the weights) and computes in float64, so what is
left is f32 summation order inside ggml's vec_dot kernels, h computed in f32 instead of f64 before
it is quantized (an element near a rounding boundary of Q8_0 / Q8_K may land one step apart) and
np.round's ties to even against ggml's roundf: |y - ref| <= 3e-3 * max|ref|. Q8_K (the vec_dot
type of K-quant weights) is emulated by round_like_ggml, not by gguf-py (which has no Q8_K
quantizer); it is held to the same bound.

What must be exact is exact: thread counts, cache sizes (waves), I/O jitter and hot sets give the
same bits.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from gguf_synth import _weights
from leanstream_convert.experts import write_expert_file
from leanstream_ggml.native._native import LeanstreamError, lib
from leanstream_ggml.model.formats import EXPERT_BIASES, EXPERT_HEADER_FIELDS, EXPERT_META_CRC_OFFSET, EXPERT_SCALES
from leanstream_ggml.model.checksum import crc32c
from leanstream_ggml.model.blockfile import read_expert_header
from leanstream_ggml.native.moe import MoEEngine
from reference import moe_reference

N_EMBD, N_FF, N_EXPERT = 256, 256, 8


def _bytes(stored: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(stored).view(np.uint8).reshape(-1)


def make_layer(path, types=("Q8_0", "Q8_0", "Q8_0"), *, il=0, seed=0, n_expert=N_EXPERT, order=None, align=4096,
               flags=0) -> dict:
    """An expert file of random experts (gate, up, down types), with random biases and scales as
    flags says; returns its header."""
    rng = np.random.default_rng(seed)
    tg, tu, td = (T[t] for t in types)
    experts = {}
    # K-quants: random bytes with f16 scales of this size (gguf_synth), whose 6-bit sub-scales make
    # values ~60x larger; scaled so that h stays where silu bends
    scale = {t: 0.001 if t.name.endswith("_K") else 0.05 for t in (tg, tu, td)}
    for e in range(n_expert):
        g, _ = _weights(rng, tg, N_FF, N_EMBD, scale[tg])
        u, _ = _weights(rng, tu, N_FF, N_EMBD, scale[tu])
        d, _ = _weights(rng, td, N_EMBD, N_FF, scale[td])
        extras = [rng.standard_normal(2 * N_FF + N_EMBD) * 0.5] if flags & EXPERT_BIASES else []
        extras += [rng.uniform(0.5, 2.0, 3)] if flags & EXPERT_SCALES else []
        experts[e] = (_bytes(g), _bytes(u), _bytes(d)) + ((np.concatenate(extras).astype(np.float32),) if extras else ())
    order = list(range(n_expert)) if order is None else order
    return write_expert_file(path, il=il, n_embd=N_EMBD, n_ff_exp=N_FF, gate_type=int(tg), up_type=int(tu),
                             down_type=int(td), expert=lambda e: experts[e], expert_of_slot=order, align=align,
                             flags=flags)


def routing(n_tokens: int, n_used: int, seed: int = 1, n_expert: int = N_EXPERT):
    """x [n_tokens, N_EMBD], ids [n_tokens, n_used] (distinct per token, experts repeated across
    tokens), weights [n_tokens, n_used] (a softmax's)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tokens, N_EMBD)).astype(np.float32)
    ids = np.stack([rng.permutation(n_expert)[:n_used] for _ in range(n_tokens)]).astype(np.int32)
    w = rng.random((n_tokens, n_used)).astype(np.float32)
    return x, ids, (w / w.sum(1, keepdims=True)).astype(np.float32)


def close_to_reference(y, ref, bound=3e-3):
    err = np.abs(y - ref).max()
    assert err <= bound * np.abs(ref).max(), f"max error {err:.3g}, max |ref| {np.abs(ref).max():.3g}"


TYPES = {
    "q8_0": ("Q8_0", "Q8_0", "Q8_0"),
    "q4_0": ("Q4_0", "Q4_0", "Q4_0"),
    "f16": ("F16", "F16", "F16"),
    "f32": ("F32", "F32", "F32"),
    "q4_K-q6_K": ("Q4_K", "Q4_K", "Q6_K"),
    "mixed": ("Q5_0", "Q8_0", "Q4_1"),
}


@pytest.fixture(scope="module", params=list(TYPES))
def layer(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "blk.0.bin"
    # slots in a shuffled order: the file's table, not the router index, says where an expert is
    make_layer(path, TYPES[request.param], order=[3, 0, 7, 5, 1, 6, 2, 4])
    return path


@pytest.mark.parametrize("n_tokens,n_used", [(1, 2), (7, 3)])
def test_op_matches_the_reference(layer, n_tokens, n_used):
    x, ids, w = routing(n_tokens, n_used)
    with MoEEngine([layer]) as m:
        y = m.eval(0, x, ids, w, n_threads=2)
    close_to_reference(y, moe_reference(layer, x, ids, w))


def test_gelu_matches_the_reference(tmp_path):
    path = tmp_path / "blk.0.bin"
    make_layer(path)
    x, ids, w = routing(5, 2)
    with MoEEngine([path], activation="gelu") as m:
        y = m.eval(0, x, ids, w)
    close_to_reference(y, moe_reference(path, x, ids, w, activation="gelu"))


# what build_moe_ffn's families compute (leanstream_ggml/model/moe_families.py): gpt-oss's
# SwiGLU-OAI over MXFP4 experts with biases, ReGLU with per-expert scales, llama4's weights before
# the experts, GELU with everything
VARIANTS = {
    "swiglu_oai-mxfp4-biases": ("swiglu_oai", EXPERT_BIASES, False, ("MXFP4", "MXFP4", "MXFP4")),
    "relu-scales": ("relu", EXPERT_SCALES, False, ("Q8_0", "Q8_0", "Q8_0")),
    "silu-weight_before": ("silu", 0, True, ("Q4_0", "Q8_0", "Q4_0")),
    "gelu-both-weight_before": ("gelu", EXPERT_BIASES | EXPERT_SCALES, True, ("Q8_0", "Q8_0", "Q8_0")),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_expert_variants_match_the_reference(tmp_path, variant):
    activation, flags, before, types = VARIANTS[variant]
    path = tmp_path / "blk.0.bin"
    h = make_layer(path, types, flags=flags, order=[3, 0, 7, 5, 1, 6, 2, 4])
    assert h["flags"] == flags and h["expert_stride"] % h["align"] == 0
    x, ids, w = routing(6, 3)
    with MoEEngine([path], activation=activation, weight_before=before) as m:
        y = m.eval(0, x, ids, w, n_threads=2)
        y1 = m.eval(0, x, ids, w, n_threads=1)
        assert m.layer_info(0)["flags"] == flags
    assert np.array_equal(y, y1)
    close_to_reference(y, moe_reference(path, x, ids, w, activation=activation, weight_before=before))


def test_threads_caches_jitter_and_hot_sets_give_the_same_bits(tmp_path):
    path = tmp_path / "blk.0.bin"
    h = make_layer(path, ("Q4_K", "Q4_K", "Q6_K"))
    x, ids, w = routing(7, 4)   # every expert of the layer in one batch
    with MoEEngine([path]) as m:
        base = m.eval(0, x, ids, w, n_threads=1)
    stride = h["expert_stride"]
    runs = [dict(memory_budget=None, n_threads=t) for t in (2, 3)]
    runs += [dict(memory_budget=c * stride, n_threads=t) for c in (2, 3) for t in (1, 2, 3)]   # waves
    runs += [dict(memory_budget=3 * stride, n_threads=2, test_hooks={"io_delay_us": 300})]
    for run in runs:
        n_threads = run.pop("n_threads")
        with MoEEngine([path], **run) as m:
            for _ in range(2):   # cold, then whatever the cache kept
                assert np.array_equal(m.eval(0, x, ids, w, n_threads=n_threads), base), (run, n_threads)
    with MoEEngine([path], memory_budget=2 * stride) as m:   # a row of a batch is that token alone
        for t in range(len(x)):
            for n_threads in (1, 3):
                assert np.array_equal(m.eval(0, x[t:t + 1], ids[t:t + 1], w[t:t + 1], n_threads=n_threads), base[t:t + 1])
    with MoEEngine([path], memory_budget=4 * stride) as m:
        m.pin(0, [5, 2])
        assert m.stats()["pinned"] == 2
        assert np.array_equal(m.eval(0, x, ids, w, n_threads=2), base)
        assert m.stats()["pinned"] == 2


def test_counters(tmp_path):
    path = tmp_path / "blk.0.bin"
    h = make_layer(path)
    x, ids, w = routing(7, 3)
    n_unique = len(np.unique(ids))
    with MoEEngine([path]) as m:
        m.eval(0, x, ids, w)
        s = m.stats()
        assert (s["tokens"], s["routed"], s["experts"]) == (7, 21, n_unique)
        assert (s["hits"], s["misses"]) == (0, n_unique)
        assert s["bytes_read"] == s["misses"] * h["expert_stride"]
        assert 1 <= s["reads"] <= s["misses"]   # adjacent slots merged
        assert s["resident"] == n_unique and s["op_calls"] == 1
        m.eval(0, x, ids, w)
        s = m.stats(0)
        assert (s["hits"], s["misses"], s["experts"]) == (n_unique, n_unique, 2 * n_unique)
        assert s["bytes_read"] == n_unique * h["expert_stride"]
        m.reset_stats()
        assert m.stats()["bytes_read"] == 0 and m.stats()["resident"] == n_unique


def test_a_cache_smaller_than_the_batch_streams_in_waves(tmp_path):
    path = tmp_path / "blk.0.bin"
    h = make_layer(path)
    x, ids, w = routing(6, 4)
    with MoEEngine([path], memory_budget=2 * h["expert_stride"]) as m:
        y = m.eval(0, x, ids, w, n_threads=2)
        s = m.stats()
        assert s["cache_slots"] == 2 and s["resident"] <= 2
        assert s["misses"] == s["experts"] == len(np.unique(ids))
        with pytest.raises(LeanstreamError, match="fewer than 2"):
            m.pin(0, [1])      # would leave 1 slot to stream through
    close_to_reference(y, moe_reference(path, x, ids, w))


def test_the_cache_slot_is_the_engine_s(tmp_path):
    """The stats' slot_bytes (the unit of the common stats' cache_bytes and cache_capacity) is the
    slot moe.c makes, for layers of different strides aligned to less than a page: a budget of k
    slots holds k, one byte less k - 1; the cache holds what it counts."""
    p0, p2 = tmp_path / "blk.0.bin", tmp_path / "blk.2.bin"
    h0 = make_layer(p0, ("Q6_K", "Q6_K", "Q6_K"), align=512)     # the larger expert, not a page multiple
    h2 = make_layer(p2, ("Q4_0", "Q4_0", "Q8_0"), il=2, seed=4, align=512)
    assert h0["expert_stride"] % 4096 and h0["expert_stride"] > h2["expert_stride"]
    x, ids, w = routing(3, 2)
    with MoEEngine([p0, None, p2]) as every:
        slot = every.stats()["slot_bytes"]
        assert slot >= max(h0["expert_stride"], h2["expert_stride"]) and every.stats()["cache_slots"] == 2 * N_EXPERT
    for budget, slots in ((3 * slot, 3), (3 * slot - 1, 2)):
        with MoEEngine([p0, None, p2], memory_budget=budget) as m:
            m.eval(0, x, ids, w)
            s = m.stats()
            assert s["cache_slots"] == slots and s["cache_capacity"] == slots * slot <= budget
            assert s["cache_bytes"] == s["resident"] * slot <= s["cache_capacity"]


def test_layers_share_the_cache_and_layers_without_experts(tmp_path):
    p0, p2 = tmp_path / "blk.0.bin", tmp_path / "blk.2.bin"
    make_layer(p0, seed=3)
    h = make_layer(p2, il=2, seed=4)
    x, ids, w = routing(3, 2)
    with MoEEngine([p0, None, p2], memory_budget=5 * h["expert_stride"]) as m:
        for il, p in ((0, p0), (2, p2), (0, p0)):
            close_to_reference(m.eval(il, x, ids, w), moe_reference(p, x, ids, w))
        assert m.stats()["resident"] <= 5
        with pytest.raises(LeanstreamError, match="no expert file"):
            m.eval(1, x, ids, w)


def test_a_corrupt_slot_is_reported_with_its_slot_and_expert(tmp_path):
    path = tmp_path / "blk.0.bin"
    h = make_layer(path, order=[3, 0, 7, 5, 1, 6, 2, 4])
    slot = 2                                          # expert 7
    with open(path, "r+b") as f:
        off = h["data_offset"] + slot * h["expert_stride"] + 100
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))
    x, ids, w = routing(2, 2)
    ids[:] = [[7, 1], [0, 7]]
    with MoEEngine([path]) as m:
        with pytest.raises(LeanstreamError, match=r"layer 0 slot 2 \(expert 7\) is corrupt") as ei:
            m.eval(0, x, ids, w)
        assert ei.value.status == lib.LS_ERR_CORRUPT
        ids[:] = [[0, 1], [1, 0]]                     # the others still compute
        close_to_reference(m.eval(0, x, ids, w), moe_reference(path, x, ids, w))
    with MoEEngine([path], verify_checksums=False) as m:   # unchecked: computed with the bad byte
        m.eval(0, x, [[7, 1], [0, 7]], w)


def test_bad_router_indices_are_an_error(tmp_path):
    path = tmp_path / "blk.0.bin"
    make_layer(path)
    x, ids, w = routing(2, 2)
    ids[1, 0] = N_EXPERT
    with MoEEngine([path]) as m:
        with pytest.raises(LeanstreamError, match=f"routes to expert {N_EXPERT}"):
            m.eval(0, x, ids, w)


def test_a_cache_below_two_experts_is_refused(tmp_path):
    path = tmp_path / "blk.0.bin"
    h = make_layer(path)
    with pytest.raises(LeanstreamError, match="at least 2") as ei:
        MoEEngine([path], memory_budget=h["expert_stride"] + 1)
    assert ei.value.status == lib.LS_ERR_BUDGET


# ---- hostile files ------------------------------------------------------------------------------

_OFFSETS = {}
_pos = 0
for _name, _code in EXPERT_HEADER_FIELDS:
    _OFFSETS[_name] = (_pos, "<" + _code)
    _pos += struct.calcsize("<" + _code)


def _patch(path, fix_crc=True, **fields):
    data_offset = read_expert_header(path)["data_offset"]
    with open(path, "r+b") as f:
        for name, value in fields.items():
            off, fmt = _OFFSETS[name]
            f.seek(off)
            f.write(struct.pack(fmt, value))
        if fix_crc:   # the geometry checks, not the checksum, must catch it
            f.seek(0)
            meta = bytearray(f.read(data_offset))
            meta[EXPERT_META_CRC_OFFSET:EXPERT_META_CRC_OFFSET + 4] = bytes(4)
            f.seek(EXPERT_META_CRC_OFFSET)
            f.write(struct.pack("<I", crc32c(meta)))


def _patch_table(path, slot, value):
    h = read_expert_header(path)
    with open(path, "r+b") as f:
        f.seek(h["table_offset"] + 4 * slot)
        f.write(struct.pack("<i", value))
        f.seek(0)
        meta = bytearray(f.read(h["data_offset"]))
        meta[EXPERT_META_CRC_OFFSET:EXPERT_META_CRC_OFFSET + 4] = bytes(4)
        f.seek(EXPERT_META_CRC_OFFSET)
        f.write(struct.pack("<I", crc32c(meta)))


HOSTILE = {
    "bad magic": (lambda p: _patch(p, magic=b"LSBLOCKS"), "bad magic", "bad magic"),
    "version": (lambda p: _patch(p, version=2), "version 2", "version 2"),
    "gate size": (lambda p: _patch(p, gate_bytes=1000), "sizes do not match", "bad expert stride"),
    "n_ff": (lambda p: _patch(p, n_ff_exp=N_FF + 32), "sizes do not match", None),
    "huge n_expert": (lambda p: _patch(p, n_expert=1 << 30), "implausibly large", "bad offsets"),
    "type": (lambda p: _patch(p, down_type=9999), "vec_dot", None),
    "align": (lambda p: _patch(p, align=3000), "alignment", "alignment"),
    "file size": (lambda p: _patch(p, file_size=123), "file_size", "file_size"),
    "layer index": (lambda p: _patch(p, il=5), "layer index", None),
    "meta crc": (lambda p: _patch(p, fix_crc=False, meta_crc=12345), "corrupt", "corrupt"),
    "flags": (lambda p: _patch(p, flags=4), "unknown flags", "unknown flags"),
    "not a permutation": (lambda p: _patch_table(p, 3, 0), "not a permutation", "not a permutation"),
    "expert out of range": (lambda p: _patch_table(p, 3, N_EXPERT), "not a permutation", "not a permutation"),
    "truncated": (lambda p: open(p, "r+b").truncate(5000), "truncated", "truncated"),
    "empty": (lambda p: open(p, "r+b").truncate(0), "truncated", "truncated"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_headers_are_refused(tmp_path, case):
    path = tmp_path / "blk.0.bin"
    make_layer(path)
    damage, native_msg, python_msg = HOSTILE[case]
    damage(path)
    with pytest.raises(LeanstreamError, match=native_msg) as ei:
        MoEEngine([path])
    assert ei.value.status in (lib.LS_ERR_FORMAT, lib.LS_ERR_CORRUPT)
    assert "blk.0.bin" in str(ei.value)
    if python_msg:
        with pytest.raises(ValueError, match=python_msg):
            read_expert_header(path)


def test_the_writer_and_the_reader_agree(tmp_path):
    path = tmp_path / "blk.3.bin"
    h = make_layer(path, ("Q4_K", "Q4_K", "Q6_K"), il=3, order=[1, 0, 2, 3, 4, 5, 7, 6], align=512)
    r = read_expert_header(path)
    assert {k: r[k] for k in h} == h
    assert list(r["expert_of_slot"]) == [1, 0, 2, 3, 4, 5, 7, 6]
    assert r["data_offset"] % 4096 == 0 and r["expert_stride"] % 512 == 0
    raw = open(path, "rb").read()
    s = r["data_offset"] + 6 * r["expert_stride"]
    assert crc32c(raw[s:s + r["expert_stride"]]) == r["slot_crc"][6]
    assert not (tmp_path / "blk.3.bin.partial").exists()
    with MoEEngine([None, None, None, path]) as m:
        info = m.layer_info(3)
        assert (info["n_embd"], info["n_ff_exp"], info["n_expert"]) == (N_EMBD, N_FF, N_EXPERT)
        assert info["expert_stride"] == h["expert_stride"]
    with pytest.raises(ValueError, match="permutation"):
        make_layer(tmp_path / "bad.bin", order=[0, 0, 1, 2, 3, 4, 5, 6])


def test_the_graph_node_gives_evals_bits(tmp_path):
    """native/tests/test_moe.c: ls_moe_build's node in a ggml graph (a strided top-k view, weights
    [1, n_used, n_tokens]) at 1 and 3 threads against ls_moe_eval, from C."""
    from c_tests import build, run

    path = tmp_path / "blk.0.bin"
    make_layer(path, ("Q4_0", "Q4_0", "Q8_0"))
    run([build("test_moe", tmp_path), path])
