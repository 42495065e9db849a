"""bench/routing_probe.py's routing figures on hand-made selections (no model)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def rp():
    if str(BENCH) not in sys.path:      # the script imports bench/benchkit.py by name
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_routing_probe", BENCH / "routing_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_by_hand(rp):
    # k = 2, T = 4; layer 0: {0,1} {1,2} {1,2} {3,4}
    #   distinct 5; lag-1 overlaps 1, 2, 0 -> (1/2 + 2/2 + 0/2) / 3 = 0.5
    #   counts 0:1 1:3 2:2 3:1 4:1 -> all 5 experts within the top 8: share 8/8 = 1
    # layer 1: the same expert pair every token -> distinct 2, lag-1 1, top-8 share 1
    l0 = [[0, 1], [2, 1], [1, 2], [4, 3]]
    l1 = [[7, 9], [9, 7], [7, 9], [9, 7]]
    s = rp.summary(np.array([l0, l1]))
    assert (s["n_layer"], s["tokens"], s["n_used"]) == (2, 4, 2)
    assert s["layers"] == [{"distinct": 5, "lag1_reuse": 0.5, "top8_share": 1.0},
                           {"distinct": 2, "lag1_reuse": 1.0, "top8_share": 1.0}]
    assert s["distinct"] == {"mean": 3.5, "min": 2.0, "max": 5.0}
    assert s["lag1_reuse"] == {"mean": 0.75, "min": 0.5, "max": 1.0}


def test_top8_share_counts_only_the_eight_hottest(rp):
    # k = 2, T = 10: expert 0 in every token, the other slot a new expert each time (1..10)
    #   distinct 11; top 8 = expert 0 (10) + 7 experts of 1 -> 17 / 20 = 0.85
    #   lag-1: expert 0 shared every step -> 1/2
    sel = np.array([[[0, t + 1] for t in range(10)]])
    s = rp.summary(sel)
    assert s["layers"][0] == {"distinct": 11, "lag1_reuse": 0.5, "top8_share": 0.85}
    # with 128 experts declared the figures do not change
    assert rp.summary(sel, n_expert=128)["layers"][0] == s["layers"][0]


def test_one_token(rp):
    # T = 1: no pair of tokens, lag-1 undefined (None, also in the spread); the rest defined
    s = rp.summary(np.array([[[3, 5, 8]], [[1, 2, 3]]]))
    assert s["layers"] == [{"distinct": 3, "lag1_reuse": None, "top8_share": 1.0}] * 2
    assert s["lag1_reuse"] is None
    assert s["distinct"] == {"mean": 3.0, "min": 3.0, "max": 3.0}


def test_rejects_a_flat_array(rp):
    with pytest.raises(ValueError):
        rp.summary(np.array([[1, 2], [3, 4]]))


def test_next_layer_recall(rp):
    # layer 1's router picks the largest input coordinates; layer 0's input predicts layer 1's
    # choice exactly for token 0 and half of it for token 1
    eye = np.eye(4, dtype=np.float32)
    norm_in = [np.array([[4, 3, 0, 0], [4, 0, 0, 3]], np.float32), np.zeros((2, 4), np.float32)]
    sel = np.array([[[0, 1], [0, 1]], [[0, 1], [0, 1]]])
    assert rp.next_layer_recall(norm_in, [eye, eye], sel) == [0.75]
    assert rp.published["qwen3-30b-a3b"]["distinct"] == 64


def test_moe_synth_norm_gains(rp):
    # bench/moe_synth.py's ffn_norm weights (calibrated/flat): none at sigma 0 (the old bytes),
    # else RMS 1, log-spread ~sigma, a fresh draw per layer, the same per seed
    spec = importlib.util.spec_from_file_location("bench_moe_synth", BENCH / "moe_synth.py")
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)
    assert ms.norm_gains(0, 3, 0.0) is None
    g0, g1 = ms.norm_gains(0, 0, 0.2), ms.norm_gains(0, 1, 0.2)
    assert g0.shape == (ms.N_EMBD,) and g0.dtype == np.float32
    assert abs(float(np.sqrt((g0 ** 2).mean())) - 1) < 1e-5
    assert 0.18 < float(np.log(g0).std()) < 0.22
    assert not np.allclose(g0, g1)
    assert np.array_equal(g0, ms.norm_gains(0, 0, 0.2))
    assert ms.ROUTING["narrow"] is None
    assert ms.ROUTING["calibrated"]["norm_gain"] == ms.ROUTING["flat"]["norm_gain"] == 0.2


@pytest.fixture(scope="module")
def ms():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_moe_synth", BENCH / "moe_synth.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_moe_synth_mxfp4_blocks(ms, tmp_path):
    # --arch gpt-oss's experts: MXFP4 blocks (1 exponent byte, 16 bytes of codes) whose values,
    # as gguf-py dequantizes them, have std ~STD and mean ~0; exponents the two bracketing STD
    import gguf

    W = ms.Writer(tmp_path / "unused.gguf", "gpt-oss")
    raw = W.quant_rows(np.random.default_rng(1), "MXFP4", 64, 2880)
    assert raw.shape == (64, 2880 // 32 * 17) and raw.dtype == np.uint8
    assert set(np.unique(raw.reshape(-1, 17)[:, 0])) == {119, 120}
    v = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType.MXFP4)
    assert abs(float(v.std()) / ms.STD - 1) < 0.02 and abs(float(v.mean())) < 0.001
    e, p = ms.mxfp4_exponents(ms.STD)
    assert e == 119 and 0 < p < 1
    b = W.quant_rows(np.random.default_rng(1), "BF16", 8, 64)
    assert b.shape == (8, 128)
    assert abs(float(gguf.quants.dequantize(b, gguf.GGMLQuantizationType.BF16).std()) / ms.STD - 1) < 0.2


def test_moe_synth_expected_bytes(ms):
    # qwen3moe as it was (16 layers ~6.6 GB); gpt-oss-20b's 24 layers ~12 GB
    assert 6.4e9 < ms.expected_bytes(16) < 6.8e9
    assert 11.5e9 < ms.expected_bytes(24, arch="gpt-oss") < 13e9


def _tokenizer(path, n=64):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(n)])
    w.add_token_types([1] * n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize("routing", ["narrow", "calibrated"])
def test_moe_synth_gpt_oss_tiny(ms, tmp_path, monkeypatch, routing):
    # a tiny gpt-oss (the writer's shape table shrunk): every tensor llama.cpp's gpt-oss loader
    # asks for, in place (check_layout), the same bytes for the same seed
    import gguf

    monkeypatch.setattr(ms, "GPT_OSS", {"n_embd": 64, "n_head": 4, "n_head_kv": 2, "head_dim": 16, "n_expert": 4,
                                        "n_expert_used": 2, "n_ff_exp": 96, "n_layer": 2, "sliding_window": 8})
    tok = _tokenizer(tmp_path / "tok.gguf")
    out = tmp_path / "tiny.gguf"
    shape = ms.write_model(out, 2, tok, seed=3, routing=routing, arch="gpt-oss")
    assert shape["arch"] == "gpt-oss" and shape["n_vocab"] == 64 and shape["tensors"] == 3 + 2 * 19
    ms.check_layout(out, shape)
    r = gguf.GGUFReader(out)
    t = {x.name: x for x in r.tensors}
    for il in range(2):
        for name in ("attn_norm.weight", "post_attention_norm.weight", "attn_sinks.weight", "attn_output.bias",
                     "attn_q.bias", "attn_k.bias", "attn_v.bias", "ffn_gate_inp.bias"):
            assert f"blk.{il}.{name}" in t
    assert t["blk.0.attn_q.weight"].tensor_type.name == "BF16" and t["output.weight"].tensor_type.name == "F16"
    assert [int(x) for x in t["blk.1.ffn_up_exps.bias"].shape] == [96, 4]
    assert r.get_field("gpt-oss.expert_used_count").contents() == 2
    del r
    again = tmp_path / "again.gguf"
    ms.write_model(again, 2, tok, seed=3, routing=routing, arch="gpt-oss")
    assert out.read_bytes() == again.read_bytes()
