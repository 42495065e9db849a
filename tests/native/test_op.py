"""The native streamed FFN op (dense mode) against the numpy reference over the same block files.

Error bound: the reference rounds x exactly as ggml does before its quantized dot products
(tests/support/reference.py: round_like_ggml) and computes in float64, so what is left is f32
summation order inside ggml's vec_dot kernels and in the down accumulation:
|y - ref| <= 1e-3 * max|ref|. One exception: for Q4_1/Q5_1 weights ggml's Q8_1 activation blocks
also carry their sum s = d*sum(q) rounded to f16, which multiplies the weights' per-block minimum;
the reference does not model that rounding (2^-11 relative on s), so those types get 5e-3.
"""

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

N_EMBD, N_FF, N_LAYER = 256, 512, 2


def _model(tmp_path_factory, types: dict, k: int = 1, shuffle: bool = False, down_type: str = "q8_0"):
    d = tmp_path_factory.mktemp("m")
    src = d / "tiny.gguf"
    write_tiny_model(src, arch="llama", n_layer=N_LAYER, n_embd=N_EMBD, n_ff=N_FF, types=types, seed=1)
    perm = None
    if shuffle:
        rng = np.random.default_rng(7)
        perm = {il: rng.permutation(N_FF) for il in range(N_LAYER)}
    m = convert(src, d / "lsm", k=k, progress=False, permutation=perm, sketch="none", down_type=down_type)
    return [m.layer_path(d / "lsm", il) for il in range(N_LAYER)]


TYPE_CASES = {
    "f32": {"ffn": "F32"},
    "f16": {"ffn": "F16"},
    "q4_0": {"ffn": "Q4_0"},
    "q4_1": {"ffn": "Q4_1"},
    "q8_0": {"ffn": "Q8_0"},
    "q4_K-q6_K": {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"},
    "q5_0-q8_0-mixed": {"gate": "Q5_0", "up": "Q8_0", "down": "Q4_1"},
    # the down columns in a K-quant (convert(down_type=...)): staged through ggml's to_float
    "q4_K-cols-q6_k": ({"gate": "Q4_K", "up": "Q4_K", "down": "Q4_K"}, "q6_k"),
    "q4_0-cols-q5_k": ({"ffn": "Q4_0"}, "q5_k"),
}


@pytest.fixture(scope="module", params=list(TYPE_CASES))
def paths(request, tmp_path_factory):
    case = TYPE_CASES[request.param]
    types, down_type = case if isinstance(case, tuple) else (case, "q8_0")
    return _model(tmp_path_factory, types, down_type=down_type)


@pytest.fixture(scope="module")
def shuffled_k3(tmp_path_factory):
    return _model(tmp_path_factory, {"ffn": "Q4_0"}, k=3, shuffle=True)


def _x(n_tokens, seed=0):
    return np.random.default_rng(seed).standard_normal((n_tokens, N_EMBD)).astype(np.float32)


Q8_1_DOT = {3, 7}  # Q4_1, Q5_1


def _check(y, ref, w=None):
    rtol = 5e-3 if w is not None and {w.gate_type, w.up_type} & Q8_1_DOT else 1e-3
    err = np.abs(y - ref).max()
    assert err <= rtol * np.abs(ref).max() + 1e-5, f"max err {err}, max |ref| {np.abs(ref).max()}"


@pytest.mark.parametrize("n_tokens", [1, 7])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_dense_matches_reference(paths, n_tokens, n_threads):
    with FFNEngine(paths) as e:
        for il in range(N_LAYER):
            x = _x(n_tokens, il)
            w = load_layer(paths[il])
            _check(e.eval_layer(il, x, n_threads=n_threads), ffn_reference(w, x), w)


def test_grouped_shuffled_blocks(shuffled_k3):
    # k=3 with a per-layer permutation and a padding slot in the last block (512 = 3*170 + 2)
    with FFNEngine(shuffled_k3) as e:
        assert e.layer_info(0)["neurons_per_block"] == 3
        for il in range(N_LAYER):
            x = _x(5, il)
            _check(e.eval_layer(il, x, n_threads=2), ffn_reference(load_layer(shuffled_k3[il]), x))


def test_streamed_equals_cached_under_random_io_delays(shuffled_k3):
    """Budget of one layer (every call re-reads) + random I/O delays: bit-identical output."""
    x = _x(3)
    layer_bytes = load_layer(shuffled_k3[0]).perm.size // 3 * blockfile.read_header(shuffled_k3[0]).block_stride
    with FFNEngine(shuffled_k3) as cached, \
            FFNEngine(shuffled_k3, memory_budget=layer_bytes, test_hooks={"io_delay_us": 300}, n_io_threads=3,
                      max_read_bytes=8192) as streamed:
        for _ in range(2):
            for il in range(N_LAYER):
                a = cached.eval_layer(il, x, n_threads=2)
                b = streamed.eval_layer(il, x, n_threads=2)
                assert np.array_equal(a, b)
        s = streamed.stats()
        assert s["miss_ratio"] == 1.0                     # nothing fits twice: every block re-read
        assert s["cache_bytes"] <= s["cache_capacity"] <= layer_bytes
        assert s["reads_issued"] > s["op_calls"]          # reads were split (8 KiB max), in flight together
        c = cached.stats()
        assert c["blocks_read"] == c["blocks_computed"] / 2  # read once, kept: second pass all hits
        assert c["loading_redundancy"] == 0.0


def test_more_threads_than_cores_and_a_busy_machine_change_no_bit(shuffled_k3):
    """8 compute threads on this machine's cores, with a busy-looping process per core: the op's
    barriers and block waits put threads to sleep (futex) instead of spinning, and the output
    equals the same op on a quiet machine bit for bit (and the reference within its bound)."""
    import subprocess
    import sys

    xs = [_x(1, 3), _x(4, 3)]   # decode and prefill paths
    with FFNEngine(shuffled_k3) as e:
        quiet = [[e.eval_layer(il, x, n_threads=8) for il in range(N_LAYER)] for x in xs]
    layer_bytes = load_layer(shuffled_k3[0]).perm.size // 3 * blockfile.read_header(shuffled_k3[0]).block_stride
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(len(os.sched_getaffinity(0)))]
    try:
        with FFNEngine(shuffled_k3) as cached, FFNEngine(shuffled_k3, memory_budget=layer_bytes, n_io_threads=2,
                                                         test_hooks={"io_delay_us": 200}) as streamed:
            for x, want in zip(xs, quiet):
                for il in range(N_LAYER):
                    assert np.array_equal(cached.eval_layer(il, x, n_threads=8), want[il])
                    assert np.array_equal(streamed.eval_layer(il, x, n_threads=8), want[il])
    finally:
        for p in busy:
            p.kill()
            p.wait()
    for x, want in zip(xs, quiet):
        for il in range(N_LAYER):
            w = load_layer(shuffled_k3[il])
            _check(want[il], ffn_reference(w, x), w)


@pytest.mark.parametrize("how", ["keyword", "wrapped"])
def test_test_hooks_are_the_engines_own(shuffled_k3, how, monkeypatch):
    """Hooks given to one engine (its test_hooks keyword, or engine_hooks.given around its
    creation, as a test does for a Llama's engine or a child process's) reach no other: an engine
    created while the faulty one is open, and one created after it, read every block intact. The
    library holds no test state, nor reads any from the environment."""
    import engine_hooks

    monkeypatch.setenv("LEANSTREAM_TEST_HOOKS", '{"fault": "eio", "fault_read": 1}')   # (read by nothing)
    x = _x(1, 6)
    with FFNEngine(shuffled_k3) as quiet:
        want = [quiet.eval_layer(il, x, n_threads=2) for il in range(N_LAYER)]
    if how == "wrapped":
        with engine_hooks.given({"fault": "eio", "fault_read": 1}):
            faulty = FFNEngine(shuffled_k3)
    else:
        faulty = FFNEngine(shuffled_k3, test_hooks={"fault": "eio", "fault_read": 1})
    with faulty, FFNEngine(shuffled_k3) as beside:
        for il in range(N_LAYER):
            assert np.array_equal(beside.eval_layer(il, x, n_threads=2), want[il])
        with pytest.raises(LeanstreamError, match="I/O error"):
            faulty.eval_layer(0, x, n_threads=2)
    with FFNEngine(shuffled_k3) as after:
        assert np.array_equal(after.eval_layer(0, x, n_threads=2), want[0])


def test_counters_answer_while_an_op_waits_for_its_reads(shuffled_k3):
    """The op holds the engine's state lock only where it pins, unpins or records: the counters,
    the residency and the last plan answer while another thread's op waits for slow reads (one
    read of 4 KiB at a time, one I/O thread, each read delayed), instead of waiting for the op to end."""
    import threading

    x = _x(1, 7)
    with FFNEngine(shuffled_k3) as quiet:
        want = quiet.eval_layer(0, x, n_threads=2)
    with FFNEngine(shuffled_k3, n_io_threads=1, max_read_bytes=4096, test_hooks={"io_delay_us": 4000}) as e:
        got = {}
        t = threading.Thread(target=lambda: got.update(y=e.eval_layer(0, x, n_threads=2)))
        t.start()
        seen = []
        while t.is_alive():
            seen.append(e.stats()["reads_issued"])
            e.resident(0)
            e.last_plan(0)
        t.join()
        total = e.stats()["reads_issued"]
        assert total > 8   # (reads of 4 KiB: a block or two each)
        # a count between none and all: read while the op was reading (a lock held for the whole
        # op would answer only before it began or after it ended)
        assert any(0 < r < total for r in seen), (total, sorted(set(seen)))
        assert np.array_equal(got["y"], want)


def test_budget_too_small_is_a_clear_error(shuffled_k3):
    with pytest.raises(LeanstreamError, match="too small"):
        FFNEngine(shuffled_k3, memory_budget=64 << 10)


@pytest.mark.parametrize("damage", ["magic", "version", "truncate_header", "truncate_data", "perm"])
def test_malformed_block_file_rejected(tmp_path, shuffled_k3, damage):
    bad = tmp_path / "blk.1.bin"
    shutil.copy(shuffled_k3[1], bad)
    h = blockfile.read_header(bad)
    with open(bad, "r+b") as f:
        if damage == "magic":
            f.write(b"NOTBLOCK")
        elif damage == "version":
            f.seek(8), f.write((99).to_bytes(4, "little"))
        elif damage == "truncate_header":
            f.truncate(100)
        elif damage == "truncate_data":
            f.truncate(h.file_size - 1000)
        elif damage == "perm":
            f.seek(h.perm_offset), f.write((0).to_bytes(4, "little") * 2)  # neuron 0 twice
    with pytest.raises(LeanstreamError, match="blk.1.bin"):
        FFNEngine([shuffled_k3[0], bad])


def test_short_read_becomes_an_error_and_the_next_call_works(tmp_path, shuffled_k3):
    p0 = tmp_path / "blk.0.bin"
    p1 = tmp_path / "blk.1.bin"
    shutil.copy(shuffled_k3[0], p0)
    shutil.copy(shuffled_k3[1], p1)
    h = blockfile.read_header(p1)
    layer_bytes = h.n_blocks * h.block_stride
    x = _x(2)
    with FFNEngine([p0, p1], memory_budget=layer_bytes) as e:
        good = e.eval_layer(1, x)
        e.eval_layer(0, x)  # evicts layer 1: the next call on it must read again
        data = p1.read_bytes()
        os.truncate(p1, h.data_offset + 10 * h.block_stride)  # the file shrinks under the engine
        with pytest.raises(LeanstreamError, match=r"blk\.1\.bin.*offset"):
            e.eval_layer(1, x)
        p1.write_bytes(data)
        assert np.array_equal(e.eval_layer(1, x), good)


def test_owner_lifetime(shuffled_k3):
    e = FFNEngine(shuffled_k3)
    e.close()
    e.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        e.eval_layer(0, _x(1))


@pytest.mark.parametrize("text,value", [("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), (4096, 4096),
                                        ("800 k", 800_000), (None, 0), ("unlimited", 0)])
def test_sizes_are_parsed_once_at_the_edge(text, value):
    """Sizes are parsed by params.size_bytes alone (Llama's options, engine_params); the engine
    takes bytes, and a size string given to it directly is a TypeError naming where to parse it."""
    from leanstream_ggml.native import params

    assert params.size_bytes(text) == value
    assert params.engine_params(memory_budget=text)["memory_budget"] == (None if text is None else value)
    if isinstance(text, str):
        with pytest.raises(TypeError, match="parsed by Llama"):
            FFNEngine([], memory_budget=text)


def test_parse_bytes_rejects_garbage():
    from leanstream_ggml.native import params

    with pytest.raises(ValueError, match="cannot parse"):
        params.size_bytes("lots")


def test_dense_keeps_a_fixed_part_resident_under_a_small_budget(shuffled_k3):
    """A dense decode scans every block in the same order: under LRU each block would be evicted
    just before its next use. The engine keeps a prefix of the scan resident instead, so a budget
    of 1.5 layers (of 2) re-reads only what does not fit."""
    h = blockfile.read_header(shuffled_k3[0])
    budget = int(1.5 * h.n_blocks) * h.block_stride
    x = _x(1)
    with FFNEngine(shuffled_k3, memory_budget=budget) as e, FFNEngine(shuffled_k3) as ref:
        for _ in range(2):
            for il in range(N_LAYER):
                assert np.array_equal(e.eval_layer(il, x), ref.eval_layer(il, x))
        first = e.stats()["blocks_read"]
        e.reset_stats()
        for il in range(N_LAYER):
            e.eval_layer(il, x)
        s = e.stats()
        pinned = budget // h.block_stride - h.n_blocks
        assert s["blocks_read"] == 2 * h.n_blocks - pinned   # per pass: everything but the pinned prefix
        assert s["cache_bytes"] <= s["cache_capacity"] <= budget
        assert first > s["blocks_read"]


def test_an_engine_runs_with_the_defaults_a_help_shows(shuffled_k3):
    """_native.mode_defaults (ls_engine_params_resolve, what options.py's help texts read) is what
    an engine of that mode, given nothing, runs with (ls_engine_get_params); bad values are refused
    there as at creation."""
    from leanstream_ggml.native import _native, modes

    with FFNEngine(shuffled_k3) as e:
        n_blocks = sum(e.layer_info(il)["n_blocks"] for il in range(N_LAYER))
    for mode in modes.MODES:
        rank = np.ones(n_blocks, dtype=np.float32) if "needs_rank" in modes.uses(mode) else None
        with FFNEngine(shuffled_k3, mode=mode, block_rank=rank) as e:
            want = _native.mode_defaults(mode)
            assert e.params == {k: want[k] for k in e.params}, mode
    assert _native.mode_defaults("leanstream")["hot_fraction"] != _native.mode_defaults("leanstream", True)["hot_fraction"]
    p = _native.ffi.new("ls_engine_params *")
    _native.lib.ls_engine_params_init(p)
    p.sparsity = 1.5
    with pytest.raises(LeanstreamError, match="sparsity must be in"):
        _native.check(_native.lib.ls_engine_params_resolve(p))
    with pytest.raises(LeanstreamError, match="NULL params"):
        _native.check(_native.lib.ls_engine_params_resolve(_native.ffi.NULL))


def _h_reference(w, x):
    """act(gate x) * up x of every neuron [n_tokens, n_ff] (float64, x rounded as ggml does)."""
    from reference import act, round_like_ggml

    xg = round_like_ggml(x, w.gate_type).astype(np.float64)
    xu = round_like_ggml(x, w.up_type).astype(np.float64)
    return act(xg @ w.gate.T.astype(np.float64)) * (xu @ w.up.T.astype(np.float64))


@pytest.mark.parametrize("n_tokens", [1, 7])
def test_capture_holds_every_neurons_h(paths, n_tokens):
    """The converter's profile (ls_engine_set_capture): a dense op writes act(gate x) * up x of each
    neuron into its slot of the capture, for the first `rows` token rows; the reference's h within
    the op's own bound (test module doc); unset, nothing is written."""
    with FFNEngine(paths) as e:
        for il in range(N_LAYER):
            x = _x(n_tokens, il)
            w = load_layer(paths[il])
            info = e.layer_info(il)
            rows = max(1, n_tokens - 2)
            cap = np.full((rows, info["n_blocks"] * info["neurons_per_block"]), np.nan, np.float32)
            e.set_capture(il, cap)
            e.eval_layer(il, x, n_threads=2)
            assert e.capture_rows(il) == rows
            ref = _h_reference(w, x)[:rows][:, w.perm]          # slot order
            _check(cap.astype(np.float64), ref, w)
            e.set_capture(il, None)
            before = cap.copy()
            e.eval_layer(il, _x(n_tokens, 99), n_threads=2)
            assert np.array_equal(cap, before, equal_nan=True)


def test_capture_by_slot_with_padding(shuffled_k3):
    """k = 3 with a shuffled order: slot b*k + j holds neuron perm[b*k + j]; padding slots are left
    as they were."""
    with FFNEngine(shuffled_k3) as e:
        info = e.layer_info(0)
        n_slots = info["n_blocks"] * info["neurons_per_block"]
        cap = np.full((4, n_slots), -7.0, np.float32)
        e.set_capture(0, cap)
        x = _x(4, 5)
        e.eval_layer(0, x, n_threads=2)
        w = load_layer(shuffled_k3[0])
        real = w.perm >= 0
        assert (~real).any() and np.all(cap[:, ~real] == -7.0)
        _check(cap[:, real].astype(np.float64), _h_reference(w, x)[:, w.perm[real]], w)
        with pytest.raises(ValueError, match="float32"):
            e.set_capture(0, np.zeros((4, n_slots), np.float64))
        with pytest.raises(ValueError, match=str(n_slots)):
            e.set_capture(0, np.zeros((4, n_slots + 1), np.float32))
