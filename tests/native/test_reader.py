"""The one reader (native/src/io.c) that brings every kind of block into the one cache
(native/src/cache.c) — a dense layer's neuron blocks and a MoE layer's experts — and the faults
injected into its reads: one test, for both kinds of block."""

from __future__ import annotations

import numpy as np
import pytest

from leanstream_convert import blockfile
from leanstream_ggml.native._native import LeanstreamError
from leanstream_ggml.native.engine import FFNEngine
from leanstream_ggml.native.moe import MoEEngine
from test_moe import make_layer, routing
from test_op import N_LAYER, _model, _x


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(a model's block files: k = 3, shuffled, a padding slot; one layer's expert file, its slots shuffled)"""
    experts = tmp_path_factory.mktemp("experts") / "blk.0.bin"
    make_layer(experts, order=[3, 0, 7, 5, 1, 6, 2, 4])
    return _model(tmp_path_factory, {"ffn": "Q4_0"}, k=3, shuffle=True), experts


@pytest.mark.parametrize("fault,message", [("eio", "I/O error"), ("short", "short read"), ("corrupt", "is corrupt")])
def test_an_injected_read_fault_is_reported_then_the_block_is_read_again(files, fault, message):
    """One read fails (test hook), whatever the blocks it brings: the op that needed them raises
    naming the layer and the cause, the failed blocks are not kept, and every later op (the blocks
    read again) equals the quiet result bit for bit. Neuron blocks under a budget of one layer (the
    second read fails: every op reads), and experts (the first read fails)."""
    dense, experts = files
    x = _x(1, 5)
    with FFNEngine(dense) as quiet:
        want = [quiet.eval_layer(il, x, n_threads=2) for il in range(N_LAYER)]
    h = blockfile.read_header(dense[0])
    with FFNEngine(dense, memory_budget=h.n_blocks * h.block_stride, test_hooks={"fault": fault, "fault_read": 2}) as e:
        with pytest.raises(LeanstreamError, match=rf"layer \d.*{message}"):
            for il in range(N_LAYER):
                e.eval_layer(il, x, n_threads=2)
        for _ in range(2):
            for il in range(N_LAYER):
                assert np.array_equal(e.eval_layer(il, x, n_threads=2), want[il])

    xe, ids, w = routing(3, 2)
    with MoEEngine([experts]) as quiet:
        want_e = quiet.eval(0, xe, ids, w, n_threads=2)
    with MoEEngine([experts], test_hooks={"fault": fault, "fault_read": 1}) as m:
        with pytest.raises(LeanstreamError, match=rf"layer 0.*{message}"):
            m.eval(0, xe, ids, w, n_threads=2)
        for _ in range(2):
            assert np.array_equal(m.eval(0, xe, ids, w, n_threads=2), want_e)

    with pytest.raises(TypeError, match="fault_reed"):
        FFNEngine(dense, test_hooks={"fault_reed": 1})
