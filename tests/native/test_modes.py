"""One owner for modes and parameters: the engine's mode table (native/src/mode.c) and its params
struct are what every Python layer asks; `serve`, `chat` and `bench` pass only what the user set."""

from __future__ import annotations

import re

import pytest

from leanstream_ggml.native import _native, engine, modes, params
from leanstream_ggml.native._native import ffi, lib


def test_mode_list_and_uses_come_from_the_engine():
    assert _native.MODES == ("dense", "oneshot", "dejavu+", "powerinfer2", "leanstream")
    assert [_native.mode_id(m) for m in _native.MODES] == list(range(lib.LS_N_MODES))
    assert ffi.NULL == lib.ls_mode_name(lib.LS_N_MODES) and lib.ls_mode_name(-1) == ffi.NULL
    assert _native.mode_uses("dense") == frozenset()
    assert _native.mode_uses("oneshot") == _native.mode_uses("dejavu+") == {"predictors", "sparse"}
    assert _native.mode_uses("powerinfer2") == {"predictors", "rank", "needs_rank", "sparse"}
    assert _native.mode_uses("leanstream") == {"sketch", "predictors", "rank", "sparse"}
    assert modes.MODES is _native.MODES                 # the public module is the engine's table
    assert [modes.uses(m) for m in modes.MODES] == [_native.mode_uses(m) for m in _native.MODES]
    assert modes.DEFAULT == "dense" and modes.QUALITY == "leanstream"
    assert modes.SPARSE == tuple(m for m in modes.MODES if m != "dense")
    assert [modes.is_cascade(m) for m in modes.MODES] == [m == "leanstream" for m in modes.MODES]
    with pytest.raises(params.ParameterError, match="^mode: unknown mode 'turbo'"):
        params.mode("turbo")
    with pytest.raises(ValueError, match="unknown mode 'turbo'"):
        _native.mode_id("turbo")


def test_engine_params_and_counters_are_read_from_the_header():
    fields = [name for name, _ in ffi.typeof("ls_engine_params").fields]
    assert set(engine.TUNABLE_PARAMS) == {"n_io_threads", "max_read_bytes", "sparsity", "hot_fraction",
                                          "candidate_ratio", "bridge_bytes"}
    assert set(engine.TUNABLE_PARAMS) < set(fields)
    # the deleted options and the test hooks are not in the public struct
    assert not {"n_stages", "cache_policy", "cache_bias", "use_direct_io", "test_io_delay_us",
                "test_io_queue_cap"} & set(fields)
    assert engine.STAT_FIELDS == [name for name, _ in ffi.typeof("ls_stats").fields]
    assert "refinements" not in engine.STAT_FIELDS


def test_unknown_engine_parameter_is_an_error_naming_it(tmp_path):
    with pytest.raises(TypeError, match="n_stages"):
        engine.FFNEngine([tmp_path / "none.bin"], n_stages=4)
    with pytest.raises(TypeError, match="io_dealy_us"):
        engine.FFNEngine([tmp_path / "none.bin"], test_hooks={"io_dealy_us": 3})


def test_mode_files_follow_the_mode_table(smollm2_sketch_dir):
    from leanstream_ggml.model import manifest

    m = manifest.load(smollm2_sketch_dir)
    files = m.mode_files(smollm2_sketch_dir, _native.mode_uses("leanstream"), "leanstream")
    assert files.sketches == m.sketch_files() and files.predictors == []
    assert files.block_freq == m.block_freq_file() is not None
    for mode in ("oneshot", "dejavu+", "powerinfer2"):
        with pytest.raises(manifest.ModeFilesError, match=re.escape(f"mode='{mode}' needs predictors")):
            m.mode_files(smollm2_sketch_dir, _native.mode_uses(mode), mode)
    ready, why = m.sparse_modes(smollm2_sketch_dir)
    assert ready == ["leanstream"] and why == "oneshot, dejavu+, powerinfer2: needs predictors"


def test_serve_passes_only_what_the_user_set(smollm2_sketch_dir):
    """`leanstream serve DIR --mode leanstream` on a sketch-only model: the engine's own defaults
    (hot set 0.9 of the cache without predictors, 16 I/O threads), as a plain Llama resolves them."""
    pytest.importorskip("fastapi", reason="leanstream serve needs the server extra")
    from fastapi.testclient import TestClient

    from leanstream_ggml import Llama
    from leanstream_ggml.commands import server

    ns = server.build_parser().parse_args([str(smollm2_sketch_dir), "--mode", "leanstream"])
    options = server.leanstream_options(ns)
    assert options == {"mode": "leanstream"}
    plain = Llama(str(smollm2_sketch_dir), mode="leanstream", n_ctx=128, verbose=False)
    want = plain.engine.params
    plain.close()
    assert want["hot_fraction"] == pytest.approx(0.9) and want["n_io_threads"] == 16
    app = server.create_app(smollm2_sketch_dir, **options)
    with TestClient(app) as client:
        got = client.get("/leanstream/stats").json()
    assert got["loaded"] and got["mode"] == "leanstream"
    assert got["params"] == want


def test_unknown_llama_keyword_names_it_and_the_nearest():
    """llama_cpp.Llama drops unknown keywords; ours refuses them before anything is opened."""
    from leanstream_ggml import Llama

    with pytest.raises(TypeError, match="'memory_limt'; did you mean 'memory_limit'"):
        Llama("/nonexistent.lsm", memory_limt="1000MB")
    with pytest.raises(TypeError, match="'n_ctxx'; did you mean 'n_ctx'"):
        Llama("/nonexistent.lsm", n_ctxx=512)
    with pytest.raises(ValueError, match="does not exist"):   # known keywords pass that check
        Llama("/nonexistent.lsm", n_ctx=512, seed=1)


def test_keywords_llama_cpp_passes_itself_are_the_ones_allowed():
    """llama-cpp-python's server loader passes keywords its Llama does not name (and ignores):
    exactly those pass our check, so an upgrade that adds one fails here, not in a user's server."""
    import inspect
    import re

    import llama_cpp
    import llama_cpp.server.model as server_model

    from leanstream_ggml import llama as ours

    src = inspect.getsource(server_model)
    call = re.search(r"_model = create_fn\((.*?)\n        \)", src, re.S)
    passed = set(re.findall(r"^\s*(\w+)=", call.group(1), re.M))
    named = set(inspect.signature(llama_cpp.Llama.__init__).parameters)
    assert passed - named == set(ours._PASSED_BY_LLAMA_CPP)
