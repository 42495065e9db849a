"""In RAM, the source GGUF on llama.cpp's own kernels where llama.cpp repacks the FFN weights
(stock.py, ``in_ram="auto"``).

SmolLM2's Q4_1 is not repacked on any CPU llama.cpp builds for: its directory keeps the op. A
Q4_0 copy of it (llama.cpp's own quantizer, requantized from the Q4_1) is repacked wherever AVX2
or ARM's dot products are: there the directory converted from it runs that GGUF, and its answers,
greedy and sampled, are stock llama-cpp-python's on the same file with the same arguments.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import shutil
import subprocess
import sys

import pytest

from leanstream_ggml import Llama
from leanstream_ggml.llamacpp import stock
from leanstream_ggml.model.manifest import GGML_TYPE_IDS

PROMPTS = ("The capital of France is", "def fibonacci(n):")
CTX = dict(n_ctx=256, n_threads=2, n_threads_batch=2, verbose=False)


@pytest.fixture(scope="module")
def q4_0(smollm2_gguf, tmp_path_factory):
    """(a Q4_0 copy of SmolLM2, the directory converted from it beside it)."""
    import llama_cpp

    from leanstream_convert import convert

    root = tmp_path_factory.mktemp("q4_0")
    gguf = root / "smollm2-q4_0.gguf"
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize, p.nthread = 2, True, 2   # LLAMA_FTYPE_MOSTLY_Q4_0
    assert llama_cpp.llama_model_quantize(str(smollm2_gguf).encode(), str(gguf).encode(), ctypes.byref(p)) == 0
    out = root / "smollm2-q4_0.lsm"
    convert(gguf, out, progress=False, sketch="none")
    return gguf, out


def _repacked_by_llama_cpp(gguf) -> bool:
    """Whether llama.cpp, loading the GGUF in a fresh process, repacks its first FFN gate."""
    code = f"import llama_cpp; llama_cpp.Llama({str(gguf)!r}, n_ctx=64, verbose=True)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return "repack tensor blk.0.ffn_gate.weight" in r.stderr


@pytest.mark.parametrize("which", ["q4_1", "q4_0"])
def test_repacks_answers_as_llama_cpps_loader_does(which, smollm2_gguf, q4_0):
    gguf = smollm2_gguf if which == "q4_1" else q4_0[0]
    # SmolLM2: n_embd 576, n_ff 1536; the gate is [576, 1536]
    assert stock.repacks(GGML_TYPE_IDS[which], 576, 1536) == _repacked_by_llama_cpp(gguf)


def _answers(llm, **sampling) -> list[list[int]]:
    out = []
    for text in PROMPTS:
        toks = llm.tokenize(text.encode(), add_bos=True)
        got = []
        for t in llm.generate(toks, reset=True, **sampling):
            if t == llm.token_eos() or len(got) >= 32:
                break
            got.append(int(t))
        out.append(got)
    return out


def test_in_ram_the_source_runs_as_llama_cpp_runs_it(q4_0):
    import llama_cpp

    gguf, model_dir = q4_0
    if not stock.repacks(GGML_TYPE_IDS["q4_0"], 576, 1536):
        pytest.skip("llama.cpp repacks no Q4_0 weights on this CPU: the op runs (the q4_1 case covers it)")
    llm = Llama(str(model_dir), **CTX)
    ref = llama_cpp.Llama(str(gguf), **CTX)
    try:
        assert llm.backend == "stock" and llm.source_path.samefile(gguf) and llm.stock_reason == ""
        assert llm.engine is None and llm.speculative == "off" and llm.stats() == {"backend": "stock", "source": str(llm.source_path)}
        greedy = dict(temp=0.0, top_k=1)
        assert _answers(llm, **greedy) == _answers(ref, **greedy)
        llm.set_seed(7), ref.set_seed(7)
        sampled = dict(temp=0.8, top_k=40, top_p=0.95)
        assert _answers(llm, **sampled) == _answers(ref, **sampled)
    finally:
        llm.close(), ref.close()


@pytest.mark.parametrize("kw, why", [
    (dict(in_ram="stream"), "in_ram='stream'"),
    (dict(memory_budget="64MiB"), "memory limit or budget"),
    (dict(speculative="self"), "speculative='self'"),
])
def test_the_op_runs_where_asked_for(q4_0, kw, why):
    llm = Llama(str(q4_0[1]), **CTX, **kw)
    try:
        assert llm.backend == "stream" and why in llm.stock_reason and llm.engine is not None
        assert llm.stats()["tokens"] == 0
    finally:
        llm.close()


def test_a_model_llama_cpp_does_not_repack_keeps_the_op(smollm2_dir):
    llm = Llama(str(smollm2_dir), **CTX)
    try:
        assert llm.backend == "stream" and "does not repack q4_1" in llm.stock_reason
    finally:
        llm.close()


def test_the_source_must_be_the_converted_file(q4_0, tmp_path, monkeypatch):
    gguf, model_dir = q4_0
    from leanstream_ggml.model import manifest

    monkeypatch.setenv("LEANSTREAM_CACHE", str(tmp_path / "cache"))   # no model cache holds it
    m = manifest.load(model_dir)
    assert stock.find_source(model_dir, m)[0].samefile(gguf)          # beside the directory
    record = json.loads((tmp_path / "cache" / stock.VERIFIED).read_text())
    assert record[str(gguf.resolve())]["sha256"] == m.source.sha256   # hashed once, remembered

    changed = tmp_path / gguf.name
    shutil.copyfile(gguf, changed)
    with open(changed, "r+b") as f:   # one byte of the last tensor's data
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 1]))
    src, why = stock.find_source(model_dir, m, str(changed))
    assert src is None and "sha256 differs" in why
    short = tmp_path / "short.gguf"
    short.write_bytes(gguf.read_bytes()[:1000])
    src, why = stock.find_source(model_dir, m, str(short))
    assert src is None and "size 1000" in why

    moved = tmp_path / "elsewhere" / model_dir.name
    shutil.copytree(model_dir, moved)
    assert m.source.path == str(gguf.resolve())                       # where it was converted from,
    assert stock.find_source(moved, m)[0].samefile(gguf)              # found from any other folder
    gone = dataclasses.replace(m, source=dataclasses.replace(m.source, path=str(tmp_path / "gone" / gguf.name)))
    src, why = stock.find_source(moved, gone)
    assert src is None and gguf.name in why and "is not in" in why
    stale = dataclasses.replace(m, source=dataclasses.replace(m.source, path=str(changed)))
    assert stock.find_source(model_dir, stale)[0].samefile(gguf)      # a stale one there: the next that holds it

    if stock.repacks(GGML_TYPE_IDS["q4_0"], 576, 1536):
        llm = Llama(str(model_dir), source=str(changed), **CTX)   # given, and not the file: the op
        try:
            assert llm.backend == "stream" and "sha256 differs" in llm.stock_reason
        finally:
            llm.close()


def test_in_ram_a_directory_converted_elsewhere_runs_its_source(q4_0, tmp_path):
    """``leanstream convert ~/Downloads/m.gguf ~/models/m.lsm``: in RAM the directory runs the GGUF
    it was converted from (where llama.cpp repacks its weights), named by info."""
    gguf, _ = q4_0
    from leanstream_convert import convert

    out = tmp_path / "models" / "m.lsm"
    convert(gguf, out, progress=False, sketch="none")
    llm = Llama(str(out), **CTX)
    try:
        if stock.repacks(GGML_TYPE_IDS["q4_0"], 576, 1536):
            assert llm.backend == "stock" and llm.source_path.samefile(gguf)
        else:
            assert llm.backend == "stream" and "does not repack" in llm.stock_reason
    finally:
        llm.close()
    r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "info", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and f"source           {gguf.resolve()}" in r.stdout, r.stdout + r.stderr


def test_info_says_what_runs_in_ram(q4_0, smollm2_dir):
    for d, want in ((q4_0[1], "the source GGUF on llama.cpp's own kernels" if stock.repacks(GGML_TYPE_IDS["q4_0"], 576, 1536)
                     else "the op (llama.cpp does not repack q4_0"),
                    (smollm2_dir, "the op (llama.cpp does not repack q4_1")):
        r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "info", str(d)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        line = next(x for x in r.stdout.splitlines() if x.startswith("in RAM"))
        assert want in line, line
