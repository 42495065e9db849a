"""Speculation on models with a recurrent state (leanstream_ggml/speculation/recurrent.py): llama.cpp
cannot drop a rejected draft from a recurrent or hybrid memory (what these tests pin of it), so
speculative="auto" drafts nothing there and says why (Llama.speculative_reason, stats(), `leanstream
info`), and "self" / "ngram" are refused. The reason is read from base.gguf's header before the model
loads and checked here against llama.cpp's own llama_model_is_recurrent / llama_model_is_hybrid on
the hybrid architectures tests/support/moe_hybrids.py writes.
Llama itself runs on converted hybrids (qwen3next, lfm2moe).
"""

from __future__ import annotations

import os

import pytest

from gguf_synth import write_tiny_model
from moe_hybrids import write_hybrid
from leanstream_ggml.llamacpp import _llama_cpp
from leanstream_ggml.speculation import recurrent

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"


def _why(arch: str, kind: str) -> str:
    return f"off: {arch} keeps a recurrent state ({kind}) that a rejected draft cannot be dropped from"


def _llama_cpp_says(path, arch: str) -> tuple[str | None, bool, bool]:
    """(recurrent.loaded, llama_model_is_hybrid, llama_model_is_recurrent) of the model llama.cpp
    loads from ``path`` (its vocabulary only: the architecture is what decides)."""
    from llama_cpp import llama_cpp as lib

    lib.llama_backend_init()
    p = lib.llama_model_default_params()
    p.vocab_only = True
    model = lib.llama_model_load_from_file(os.fspath(path).encode(), p)
    assert model, f"llama.cpp does not load {path}"
    try:
        return recurrent.loaded(model, arch), bool(lib.llama_model_is_hybrid(model)), bool(lib.llama_model_is_recurrent(model))
    finally:
        lib.llama_model_free(model)


@pytest.mark.parametrize("arch, kw, kind", [
    ("qwen3next", {}, "hybrid: layers 0, 2 of 4 recurrent"),
    ("qwen3next", {"mtp": True}, "hybrid: layers 0, 2 of 4 recurrent"),          # (the MTP block: attention)
    ("qwen3next", {"n_layer": 12, "full_attention_interval": 4}, "hybrid: 9 of 12 layers recurrent"),
    ("qwen35moe", {}, "hybrid: layers 0, 2 of 4 recurrent"),
    ("lfm2moe", {}, "hybrid: layers 0, 2 of 4 recurrent"),
    ("nemotron_h_moe", {"n_layer": 8}, "hybrid: layers 0, 4 of 8 recurrent"),     # (Mamba-2; MoE, attention)
], ids=["qwen3next", "qwen3next-mtp", "qwen3next-12", "qwen35moe", "lfm2moe", "nemotron_h_moe"])
def test_the_reason_names_the_recurrent_layers_and_agrees_with_llama_cpp(tmp_path, arch, kw, kind):
    info = write_hybrid(tmp_path / f"{arch}.gguf", arch, seed=1, **kw)
    if len(info["recurrent_layers"]) <= 8:
        assert kind == f"hybrid: layers {', '.join(map(str, info['recurrent_layers']))} of {info['n_layer']} recurrent"
    assert recurrent.reason(tmp_path / f"{arch}.gguf") == _why(arch, kind)
    loaded, hybrid, is_recurrent = _llama_cpp_says(tmp_path / f"{arch}.gguf", arch)
    assert hybrid and not is_recurrent
    assert loaded == _why(arch, "hybrid: recurrent and attention layers")


@pytest.mark.parametrize("arch, kw", [("llama", {}), ("qwen3", {}), ("qwen3moe", {"moe_experts": 4})])
def test_a_transformer_keeps_speculation(tmp_path, arch, kw):
    write_tiny_model(tmp_path / "m.gguf", arch=arch, n_layer=2, **kw)
    assert recurrent.reason(tmp_path / "m.gguf") is None
    assert _llama_cpp_says(tmp_path / "m.gguf", arch) == (None, False, False)


def test_the_table_is_llama_cpps():
    # src/llama-arch.cpp's llm_arch_is_recurrent / llm_arch_is_hybrid of the pinned llama.cpp, read
    # from the sdist the build was made from (the loaded models above check the architectures tests
    # can write)
    import tarfile

    from leanstream_ggml import build

    sdist = build.cache_dir() / "sdist" / f"llama_cpp_python-{build.LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.exists():
        pytest.skip(f"no llama-cpp-python sdist at {sdist}")
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("vendor/llama.cpp/src/llama-arch.cpp"))
        text = tar.extractfile(member).read().decode()
    import re

    names = dict(re.findall(r"\{\s*(LLM_ARCH_\w+),\s*\"([^\"]+)\"\s*\}", text))

    def cases(fn: str) -> set[str]:
        body = re.search(rf"bool {fn}\(const llm_arch & arch\) \{{(.*?)\n\}}", text, re.S).group(1)
        return {names[a] for a in re.findall(r"case (LLM_ARCH_\w+):", body)}

    assert recurrent.RECURRENT == cases("llm_arch_is_recurrent")
    assert recurrent.HYBRID == cases("llm_arch_is_hybrid")


@pytest.mark.parametrize("arch", ["qwen3next", "lfm2moe"])
def test_llama_cpp_cannot_drop_a_rejected_draft_from_a_recurrent_state(tmp_path, arch):
    """What recurrent.py's reason rests on: after a draft token is decoded, seq_rm of its position
    is refused (false, nothing changed) for sequence 0 and for every sequence, where a
    transformer's KV cache drops it; a whole sequence is removed."""
    import llama_cpp
    from llama_cpp import llama_cpp as lib

    write_hybrid(tmp_path / "h.gguf", arch, seed=1)
    write_tiny_model(tmp_path / "t.gguf", arch="llama", n_layer=2)
    for name, drops in (("h.gguf", False), ("t.gguf", True)):
        with _llama_cpp.context_params(n_seq_max=2, kv_unified=True):
            llm = llama_cpp.Llama(str(tmp_path / name), n_ctx=128, verbose=False, flash_attn=True)
        try:
            llm.eval(llm.tokenize(PROMPT.encode()))
            n, mem = llm.n_tokens, lib.llama_get_memory(llm.ctx)
            _llama_cpp.decode(llm, [5], [n], all_rows=False)       # a draft step
            assert lib.llama_memory_seq_pos_max(mem, 0) == n
            assert lib.llama_memory_seq_rm(mem, 0, n, -1) is drops
            assert lib.llama_memory_seq_rm(mem, -1, n, -1) is drops
            assert lib.llama_memory_seq_pos_max(mem, 0) == (n - 1 if drops else n)
            lib.llama_memory_seq_cp(mem, 0, 1, -1, -1)
            assert lib.llama_memory_seq_rm(mem, 1, -1, -1)          # a whole sequence: the tree's others
        finally:
            llm.close()


# ---- Llama ------------------------------------------------------------------------------------------

def _greedy(llm, n: int = 24) -> list[int]:
    out = []
    for t in llm.generate(llm.tokenize(PROMPT.encode()), temp=0.0):
        out.append(t)
        if len(out) == n:
            break
    return out


def _check_llama(d, why: str, capsys) -> None:
    """speculative="auto" on ``d`` drafts nothing, says ``why`` and decodes as "off" token for token;
    "ngram" and "self" are refused with it; `leanstream info` prints it; the memory plan counts one
    logit row, as without speculation."""
    from leanstream_ggml import Llama
    from leanstream_ggml.llama import memory_plan
    from leanstream_ggml.cli import main
    from leanstream_ggml.native import params

    kw = dict(n_ctx=256, verbose=False, in_ram="stream", n_threads=2)
    llm = Llama(str(d), speculative="auto", **kw)
    try:
        assert llm.speculative == "off" and llm.speculative_reason == why
        assert llm._drafter is None and llm._n_seq == 1
        s = llm.stats()
        assert s["speculative_reason"] == why and "speculative" not in s
        auto = _greedy(llm)
    finally:
        llm.close()
    llm = Llama(str(d), speculative="off", **kw)
    try:
        assert llm.speculative_reason is None and "speculative_reason" not in llm.stats()
        assert _greedy(llm) == auto
    finally:
        llm.close()
    for kind in ("ngram", "self"):
        with pytest.raises(params.ParameterError, match="speculative") as e:
            Llama(str(d), speculative=kind, **kw)
        assert str(e.value) == (f"speculative: {kind!r} drafts, but {why.removeprefix('off: ')}; "
                                f"use speculative='auto' (which drafts nothing here) or 'off'")
    assert memory_plan(d, "1GB").parts["logits"] == memory_plan(d, "1GB", speculative="off").parts["logits"]
    assert main(["info", str(d)]) == 0
    assert f"\nspeculative      {why}\n" in capsys.readouterr().out


@pytest.mark.parametrize("arch", ["qwen3next", "lfm2moe"])
def test_llama_on_a_converted_hybrid_drafts_nothing_and_says_why(tmp_path, arch, capsys):
    from leanstream_convert import convert

    info = write_hybrid(tmp_path / f"{arch}.gguf", arch, seed=1)
    convert(tmp_path / f"{arch}.gguf", tmp_path / "lsm", progress=False)
    layers = ", ".join(map(str, info["recurrent_layers"]))
    _check_llama(tmp_path / "lsm", _why(arch, f"hybrid: layers {layers} of {info['n_layer']} recurrent"), capsys)
