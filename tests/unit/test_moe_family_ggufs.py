"""The synthetic mixture-of-experts families (tests/support/moe_families.py) in stock llama.cpp:
each family and variant loads and decodes to finite, non-uniform logits, and its routed experts
decide the next token (the same model with other experts disagrees on most argmaxes); the tensors
in the file are the layout write_family reports; fused gate/up experts are the same model as
separate ones."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
from moe_families import FAMILIES, write_family

TOKS = list(range(3, 19))      # 16 byte tokens
# (id, arch, write_family keywords): every family as written by default, plus the variants
CASES = [(a, a, {}) for a in FAMILIES] + [
    ("glm4moe-nextn1", "glm4moe", {"nextn": 1}),
    ("deepseek2-fused", "deepseek2", {"fused_gate_up": True}),
    ("deepseek2-groups", "deepseek2", {"expert_groups": 4}),
    ("gemma4-fused", "gemma4", {"fused_gate_up": True}),
    ("gpt-oss-q8_0", "gpt-oss", {"expert_type": "Q8_0"}),
    ("granitemoe-mxfp4", "granitemoe", {"expert_type": "MXFP4"}),
    ("dots1-q4_0", "dots1", {"expert_type": "Q4_0"}),
    ("llama4-f16-every-layer", "llama4", {"expert_type": "F16", "moe_step": 1}),
]
EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.")


def _logits(path) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed")
    llm = llama_cpp.Llama(str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2)
    try:
        assert llm.n_vocab() == 267
        llm.eval(TOKS)
        return np.array(llm.scores[:len(TOKS)])
    finally:
        llm.close()


def _check_layout(path, info) -> None:
    """The file's tensors per layer are what info says: routers and experts in the MoE (and MTP)
    layers, the dense FFN in the dense layers (and in gemma4's MoE layers, beside the experts)."""
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    arch = info["arch"]
    assert info["block_count"] == info["n_layer"] + len(info["mtp_layers"])
    assert sorted(info["moe_layers"] + info["dense_layers"]) == list(range(info["n_layer"]))
    experts = {n for n in names if EXPERT_RE.match(n)}
    listed = {n for il in info["expert_tensors"] for n in info["expert_tensors"][il]}
    assert experts == listed
    assert sorted(info["expert_tensors"]) == info["moe_layers"] + info["mtp_layers"]
    for il in info["moe_layers"] + info["mtp_layers"]:
        p = f"blk.{il}."
        assert p + "ffn_gate_inp.weight" in names
        assert (p + "ffn_gate_up_exps.weight" in names) == info["fused_gate_up"]
        assert (p + "ffn_gate_exps.weight" in names) == (not info["fused_gate_up"])
        assert p + "ffn_down_exps.weight" in names
        assert (p + "ffn_gate.weight" in names) == (arch == "gemma4")
        assert (p + "ffn_up_shexp.weight" in names) == (info["n_ff_shexp"] > 0)
        assert (p + "nextn.eh_proj.weight" in names) == (il in info["mtp_layers"])
        if arch == "gpt-oss":
            assert {p + f"ffn_{r}_exps.bias" for r in ("gate", "up", "down")} | {p + "ffn_gate_inp.bias"} <= names
        if arch == "gemma4":
            assert {p + "ffn_gate_inp.scale", p + "ffn_down_exps.scale"} <= names
    for il in info["dense_layers"]:
        p = f"blk.{il}."
        assert {p + "ffn_gate.weight", p + "ffn_up.weight", p + "ffn_down.weight"} <= names
        assert p + "ffn_gate_inp.weight" not in names
    assert info["tensors"].keys() == names


@pytest.mark.parametrize("arch, kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_family_loads_decodes_and_its_experts_decide(tmp_path, arch, kw):
    src = tmp_path / "a.gguf"
    info = write_family(src, arch, seed=0, **kw)
    assert info["arch"] == arch and src.stat().st_size < 2_000_000
    _check_layout(src, info)
    assert info["moe_layers"]
    ref = _logits(src)
    assert np.isfinite(ref).all()
    assert ref.std(axis=1).min() > 1.0                  # not all equal: peaked
    assert len(set(ref.argmax(1))) > 3
    other = tmp_path / "b.gguf"
    info_b = write_family(other, arch, seed=0, expert_seed=1, **kw)
    for name, v in info["tensors"].items():   # only the routed experts differ
        is_expert = any(name in n for n in info["expert_tensors"].values())
        assert np.array_equal(v, info_b["tensors"][name]) != is_expert, name
    agree = (_logits(other).argmax(1) == ref.argmax(1)).mean()
    assert agree <= 0.5, agree


@pytest.mark.parametrize("arch", ["deepseek2", "gemma4"])
def test_fused_gate_up_is_the_same_model(tmp_path, arch):
    """ffn_gate_up_exps holds each expert's gate rows, then its up rows: the same logits as the
    separate ffn_gate_exps / ffn_up_exps of the same seed."""
    a, b = tmp_path / "sep.gguf", tmp_path / "fused.gguf"
    sep = write_family(a, arch)
    fused = write_family(b, arch, fused_gate_up=True)
    il = sep["moe_layers"][0]
    gu = fused["tensors"][f"blk.{il}.ffn_gate_up_exps.weight"]
    n = sep["n_ff_exp"]
    assert np.array_equal(gu[:, :n], sep["tensors"][f"blk.{il}.ffn_gate_exps.weight"])
    assert np.array_equal(gu[:, n:], sep["tensors"][f"blk.{il}.ffn_up_exps.weight"])
    assert np.array_equal(_logits(a), _logits(b))


def test_layouts_and_refusals(tmp_path):
    p = tmp_path / "x.gguf"
    assert write_family(p, "glm4moe")["mtp_layers"] == []
    info = write_family(p, "glm4moe", nextn=1)
    layout = (info["block_count"], info["moe_layers"], info["dense_layers"], info["mtp_layers"])
    assert layout == (4, [1, 2], [0], [3])
    info = write_family(p, "llama4")
    assert (info["moe_layers"], info["dense_layers"]) == ([1, 3], [0, 2])
    info = write_family(p, "deepseek2", n_layer=4)
    assert (info["moe_layers"], info["dense_layers"]) == ([1, 2, 3], [0])
    assert write_family(p, "gpt-oss")["expert_type"] == "MXFP4"
    for arch, kw in (("glm4moe", {"fused_gate_up": True}), ("gpt-oss", {"fused_gate_up": True}),
                     ("ernie4_5-moe", {"moe_step": 2}), ("deepseek2", {"nextn": 1}),
                     ("glm4moe", {"expert_groups": 4}), ("dots1", {"n_layer": 1}),
                     ("gpt-oss", {"n_embd": 48}), ("dots1", {"expert_type": "IQ2_XXS"}), ("mixtral", {})):
        with pytest.raises(ValueError):
            write_family(p, arch, **kw)
