"""Mixture-of-experts models end to end (docs/design.md §24): the four layouts written by
gguf_synth, converted with the default `leanstream convert`, run by Llama with the routed experts
streamed from their expert files (patches/0005's hook, native/src/moe.c), against stock
llama-cpp-python on the source GGUF, teacher-forced over 96 tokens; in RAM and under a budget
whose cache holds a fraction of the experts (every pass reads the rest). Greedy answers with
speculation (prompt lookup) equal plain decoding's. `leanstream verify` checks every expert."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
from gguf_synth import write_tiny_model  # noqa: E402

LAYOUTS = {"qwen3moe": {}, "qwen2moe": {"n_ff_shexp": 64}, "olmoe": {}, "mixtral": {}}
N_TOKENS = 96


def _arch(layout: str) -> str:
    return "llama" if layout == "mixtral" else layout


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_moe):
    """{layout: (source GGUF, model directory)}, converted through the command line's defaults
    (qwen3moe: the session's tiny_moe, the same model)."""
    from leanstream_ggml.cli import main

    d = tmp_path_factory.mktemp("moe")
    out = {"qwen3moe": tiny_moe}
    for layout, extra in LAYOUTS.items():
        if layout in out:
            continue
        src = d / f"{layout}.gguf"
        write_tiny_model(src, arch=_arch(layout), n_layer=2, moe_experts=8, moe_used=2, seed=3, scales="peaked",
                         **extra)
        assert main(["convert", str(src), str(d / f"{layout}.lsm"), "--quiet"]) == 0
        out[layout] = (src, d / f"{layout}.lsm")
    return out


def _stride(model) -> int:
    """The bytes of one expert of the model (every layer's the same here)."""
    from leanstream_ggml.model import manifest

    return manifest.load(model).moe.layers[0].expert_stride


def _small_cache(model) -> int:
    """A budget of 5 experts' bytes: fewer than one layer's 8 (and than a batch's 16 over 2 layers)."""
    return 5 * _stride(model)


def _tokens(seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, N_TOKENS)]


def _scores(llm, toks) -> np.ndarray:
    llm.eval(toks)
    return np.array(llm.scores[:len(toks)], dtype=np.float64)


def _log_softmax(a):
    a = a - a.max(-1, keepdims=True)
    return a - np.log(np.exp(a).sum(-1, keepdims=True))


def _agreement_kl(ref, got) -> tuple[float, float]:
    lp, lq = _log_softmax(ref), _log_softmax(got)
    return float((ref.argmax(-1) == got.argmax(-1)).mean()), float((np.exp(lp) * (lp - lq)).sum(-1).mean())


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("where", ["in_ram", "streamed"])
def test_logits_match_stock(converted, layout, where):
    from leanstream_ggml import Llama

    src, model = converted[layout]
    toks = _tokens(7)
    # stock with flash attention, as Llama runs by default (docs/design.md §21): the comparison is
    # then of the routed experts alone
    ref = llama_cpp.Llama(str(src), n_ctx=128, logits_all=True, verbose=False, n_threads=2, flash_attn=True)
    want = _scores(ref, toks)
    ref.close()
    kw = {"in_ram": "stream"} if where == "in_ram" else {"memory_budget": _small_cache(model)}
    llm = Llama(str(model), n_ctx=128, logits_all=True, verbose=False, n_threads=2, **kw)
    assert llm.backend == "stream" and llm.manifest.moe is not None
    got = _scores(llm, toks)
    s = llm.stats()
    llm.close()
    agree, kl = _agreement_kl(want, got)
    assert agree >= 0.95 and kl <= 0.01, (layout, where, agree, kl)
    assert s["routed"] == 2 * 2 * N_TOKENS           # layers x experts a token is routed to x tokens
    assert s["tokens"] == N_TOKENS                   # token rows the model processed (not summed over layers)
    stride = llm.manifest.moe.layers[0].expert_stride
    assert s["bytes_read"] == (s["misses"] + s["pin_loads"] + s["ahead_reads"]) * stride
    if where == "streamed":
        # the cache holds fewer experts than a layer has: the batch (every expert of both layers
        # routed to) streams through it in waves, each expert not in the hot set read once
        assert 2 <= s["cache_slots"] < 8 and s["misses"] == 2 * 8 - s["pinned"]


def test_a_decode_reads_only_its_routed_misses(converted):
    """Token by token under a small cache: each decode reads at most its routed experts, every
    read is a miss of the cache (bytes = misses x stride), and what stays cached hits."""
    from leanstream_ggml import Llama

    _, model = converted["qwen3moe"]
    llm = Llama(str(model), n_ctx=128, verbose=False, n_threads=2, memory_budget=_small_cache(model), speculative="off")
    for t in _tokens(11)[:24]:
        before = llm.stats()
        llm.eval([t])
        s = llm.stats()
        assert s["routed"] - before["routed"] == 2 * 2
        assert s["misses"] - before["misses"] <= 2 * 2
    s = llm.stats()
    stride = llm.manifest.moe.layers[0].expert_stride
    assert s["hits"] > 0 and s["bytes_read"] == s["blocks_read"] * stride == (s["misses"] + s["pin_loads"] + s["ahead_reads"]) * stride
    llm.close()


def test_read_ahead_finds_llama_cpp_s_routers_and_changes_no_bit(converted):
    """Each layer's router is found in llama.cpp's graph; layer 1's experts are predicted from layer
    0's input and read early (on), scored (recall), and the logits are plain decoding's bit for bit."""
    from leanstream_ggml import Llama

    _, model = converted["qwen3moe"]
    toks = _tokens(12)[:32]
    scores, stats = {}, {}
    for ahead in ("off", "on"):
        llm = Llama(str(model), n_ctx=128, verbose=False, n_threads=2, memory_budget=_small_cache(model),
                    speculative="off", read_ahead=ahead, logits_all=True)
        rows = []
        for t in toks:   # one token a step: read-ahead predicts decode batches
            llm.eval([t])
            rows.append(np.array(llm.scores[llm.n_tokens - 1]))
        scores[ahead], stats[ahead] = np.stack(rows), llm.stats()
        llm.close()
    assert np.array_equal(scores["on"], scores["off"])
    on, off = stats["on"], stats["off"]
    assert on["router_known"] == 2 and on["ahead_ops"] == len(toks) and on["ahead_reads"] > 0
    assert 0 < on["ahead_predicted"] <= on["ahead_routed"] and 0 <= on["ahead_recall"] <= 1
    assert off["ahead_reads"] == 0 and off["ahead_on"] == 0


@pytest.mark.parametrize("layout", ["qwen3moe", "qwen2moe"])
def test_speculation_equals_plain_greedy(converted, layout):
    from leanstream_ggml import Llama

    _, model = converted[layout]
    prompt = "abc abc abc def abc abc"
    answers = {}
    for spec in ("off", "auto"):
        llm = Llama(str(model), n_ctx=256, verbose=False, n_threads=2, memory_budget=_small_cache(model), speculative=spec)
        assert llm.speculative == ("off" if spec == "off" else "ngram")
        answers[spec] = llm.create_completion(prompt, max_tokens=48, temperature=0.0)["choices"][0]["text"]
        if spec != "off":
            assert llm.stats()["speculative"]["passes"] > 0
        llm.close()
    assert answers["auto"] == answers["off"]


def test_sparse_modes_and_the_self_draft_are_refused_with_why(converted):
    from leanstream_ggml import Llama

    _, model = converted["olmoe"]
    with pytest.raises(ValueError, match="mixture-of-experts model runs in dense mode"):
        Llama(str(model), mode="leanstream", verbose=False)
    with pytest.raises(ValueError, match="prompt lookup"):
        Llama(str(model), speculative="self", verbose=False)


def test_in_ram_by_default_runs_the_source_on_llama_cpp(converted):
    """No limit, no budget: the source GGUF beside the directory runs on llama.cpp's own kernels."""
    from leanstream_ggml import Llama

    src, model = converted["qwen3moe"]
    llm = Llama(str(model), n_ctx=128, verbose=False, n_threads=2)
    assert llm.backend == "stock" and llm.source_path == src
    llm.close()


def test_verify_catches_a_corrupt_expert(converted, tmp_path):
    from leanstream_ggml.cli import main
    from leanstream_ggml.commands.verify import verify_dir

    _, model = converted["mixtral"]
    copy = tmp_path / "copy.lsm"
    shutil.copytree(model, copy)
    assert verify_dir(copy)[0] == []
    from leanstream_ggml.model import manifest

    e = manifest.load(copy).moe.layers[1]
    f = copy / e.file
    with open(f, "r+b") as fh:
        fh.seek(e.data_offset + 3 * e.expert_stride + 100)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    problems, _ = verify_dir(copy)
    assert len(problems) == 1 and "layer 1 slot 3" in problems[0] and "corrupt" in problems[0]
    assert main(["verify", str(copy)]) == 1


def test_stats_and_the_engine_answer_as_a_dense_model_s(tiny_moe, tiny_dense):
    """What a command or a tool reads without knowing the model's kind: Llama.stats() has the same
    top-level fields on a dense and a MoE model (engine.COMMON_STATS, "speculative"), differing only
    in each engine's documented own fields (OWN_STATS); the engine has memory_budget and params. A
    MoE model's common counters are its experts' (an expert is a block)."""
    from leanstream_ggml import Llama
    from leanstream_ggml.native.engine import COMMON_STATS, FFNEngine
    from leanstream_ggml.native.moe import MoEEngine

    stats, engines = {}, {}
    for kind, (_, model) in (("dense", tiny_dense), ("moe", tiny_moe)):
        llm = Llama(str(model), n_ctx=128, verbose=False, n_threads=2, memory_budget=_small_cache(tiny_moe[1]))
        llm.eval(_tokens(5)[:16])
        for t in _tokens(6)[:4]:
            llm.eval([t])
        stats[kind] = llm.stats()
        engines[kind] = (type(llm.engine), llm.engine.memory_budget, llm.engine.params)
        llm.close()
    dense, moe = set(stats["dense"]), set(stats["moe"])
    assert {*COMMON_STATS, "speculative"} <= dense & moe
    assert dense - moe <= set(FFNEngine.OWN_STATS) and moe - dense <= set(MoEEngine.OWN_STATS)
    assert not set(FFNEngine.OWN_STATS) & set(MoEEngine.OWN_STATS)
    assert not (set(FFNEngine.OWN_STATS) | set(MoEEngine.OWN_STATS)) & set(COMMON_STATS)
    for kind, want in (("dense", FFNEngine), ("moe", MoEEngine)):
        cls, budget, params = engines[kind]
        assert cls is want and budget == _small_cache(tiny_moe[1])
        assert params["n_io_threads"] > 0 and params["max_read_bytes"] > 0
    s, stride = stats["moe"], _stride(tiny_moe[1])
    assert s["tokens"] == 20 and s["op_calls"] == 2 * 5      # the prompt's pass and 4 decode passes, 2 layers
    assert s["blocks_computed"] == s["experts"] and s["blocks_read"] == s["misses"] + s["pin_loads"] + s["ahead_reads"] > 0
    assert s["bytes_read"] == s["blocks_read"] * stride and s["reads_issued"] == s["reads"]
    assert s["miss_ratio"] == s["blocks_read"] / s["blocks_computed"]
    assert 0 < s["cache_bytes"] <= s["cache_capacity"] <= _small_cache(tiny_moe[1])
    assert s["op_ns"] >= s["io_stall_ns"] and s["resident_bytes"] == 0 and s["hot_blocks"] == s["pinned"]

