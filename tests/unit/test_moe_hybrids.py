"""The hybrid recurrent mixture-of-experts GGUFs of tests/support/moe_hybrids.py (qwen3next, qwen35moe,
lfm2moe, nemotron_h_moe): each loads in llama.cpp (llama-cpp-python) as a hybrid model and decodes to
finite, varied logits; its routed experts decide the next token (the same model with other expert
weights disagrees on the argmax at many positions); the fused ffn_gate_up_exps file computes what
the unfused one does; the MTP block is in the file but not in the trunk's computation."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
from moe_hybrids import FUSABLE, HYBRIDS, MTP_ARCHS, write_hybrid

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed")

TOKS = [int(t) for t in np.random.default_rng(7).integers(3, 267, size=16)]
# (name, arch, write_hybrid keywords)
VARIANTS = [(a, a, {}) for a in HYBRIDS] + [(f"{a}-fused", a, {"fused_gate_up": True}) for a in FUSABLE] + \
    [("qwen3next-f16", "qwen3next", {"expert_type": "F16"}), ("lfm2moe-q4_0", "lfm2moe", {"expert_type": "Q4_0"}),
     ("nemotron_h_moe-q4_0", "nemotron_h_moe", {"expert_type": "Q4_0"})]


def _run(path) -> tuple[np.ndarray, bool, bool]:
    """(logits [len(TOKS), n_vocab], llama_model_is_recurrent, llama_model_is_hybrid)."""
    llm = llama_cpp.Llama(str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2)
    try:
        assert llm.n_vocab() == 267
        model = llm.model
        flags = bool(llama_cpp.llama_cpp.llama_model_is_recurrent(model)), \
            bool(llama_cpp.llama_cpp.llama_model_is_hybrid(model))
        llm.eval(TOKS)
        return np.array(llm.scores[:len(TOKS)]), *flags
    finally:
        llm.close()


@pytest.mark.parametrize("name,arch,kw", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_loads_decodes_and_experts_decide(tmp_path, name, arch, kw):
    src = tmp_path / "a.gguf"
    info = write_hybrid(src, arch, seed=0, **kw)
    assert os.path.getsize(src) < 2 << 20
    assert info["recurrent_layers"] and info["attention_layers"] and info["moe_layers"]
    names = {t.name for t in gguf.GGUFReader(src).tensors}
    for il in info["moe_layers"]:
        assert set(info["expert_tensors"][il]) <= names
        assert (f"blk.{il}.ffn_gate_up_exps.weight" in names) == info["fused_gate_up"]
    logits, recurrent, hybrid = _run(src)
    assert (recurrent, hybrid) == (False, True)
    assert np.isfinite(logits).all()
    assert np.ptp(logits, axis=1).min() > 0.5                    # not all equal, at every position
    assert len(set(logits.argmax(1).tolist())) > 3               # nor the same token everywhere

    other = tmp_path / "b.gguf"                                  # the same model, other routed experts
    write_hybrid(other, arch, seed=0, expert_seed=1, **kw)
    logits_b, _, _ = _run(other)
    assert np.isfinite(logits_b).all()
    disagree = (logits.argmax(1) != logits_b.argmax(1)).mean()
    assert disagree >= 0.5, f"{name}: the argmax changes at only {disagree:.0%} of positions"


@pytest.mark.parametrize("arch", FUSABLE)
def test_fused_gate_up_computes_the_same(tmp_path, arch):
    write_hybrid(tmp_path / "u.gguf", arch, seed=3)
    info = write_hybrid(tmp_path / "f.gguf", arch, seed=3, fused_gate_up=True)
    t = info["tensors"]
    il = info["moe_layers"][0]
    assert t[f"blk.{il}.ffn_gate_up_exps.weight"].shape == (info["n_expert"], 2 * info["n_ff_exp"], info["n_embd"])
    np.testing.assert_allclose(_run(tmp_path / "u.gguf")[0], _run(tmp_path / "f.gguf")[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_mtp_block_loads_and_is_not_in_the_trunk(tmp_path, arch):
    base = write_hybrid(tmp_path / "n.gguf", arch, seed=5)
    info = write_hybrid(tmp_path / "m.gguf", arch, seed=5, mtp=True)
    mtp = info["block_count"] - 1
    assert info["mtp_layers"] == [mtp] and mtp in info["moe_layers"] and info["n_layer"] == base["n_layer"]
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    assert int(r.fields[f"{arch}.nextn_predict_layers"].contents()) == 1
    names = {x.name for x in r.tensors}
    assert {f"blk.{mtp}.nextn.eh_proj.weight", f"blk.{mtp}.ffn_down_exps.weight"} <= names
    np.testing.assert_array_equal(_run(tmp_path / "n.gguf")[0], _run(tmp_path / "m.gguf")[0])
