"""What the converter refuses, by architecture, and says so naming it: mixture-of-experts families
whose experts the op does not compute (leanstream_ggml/model/moe_families.py; the families it
converts: tests/unit/test_moe_convert.py, tests/e2e/test_moe_families.py), architectures whose FFN is
not gated (gpt2, starcoder, phi2: not in the activation table), a gated architecture's file
without ffn_gate, and a phi3 whose ffn_up is not the fused [2 n_ff, n_embd] its llama.cpp graph
splits. The dense architectures it converts are run against stock llama.cpp in
tests/e2e/test_archs.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf_synth import write_tiny_model
from reference import load_layer

from leanstream_convert import ConvertError, convert
from leanstream_convert.convert_gguf import FUSED_GATE_UP
from leanstream_ggml.model import manifest as mf


def _convert(src, tmp_path):
    return convert(src, tmp_path / "o", progress=False, sketch="none")


@pytest.mark.parametrize("arch", ["nemotron_h_moe", "grovemoe", "mixtral9000"])
def test_moe_families_the_op_cannot_compute_are_refused_naming_them(tmp_path, arch):
    src = tmp_path / f"{arch}.gguf"
    _header(src, arch, {"blk.0.ffn_gate_inp.weight": (4, 32), "blk.0.ffn_gate_exps.weight": (4, 64, 32),
                        "blk.0.ffn_up_exps.weight": (4, 64, 32), "blk.0.ffn_down_exps.weight": (4, 32, 64)},
            n_expert=4)
    with pytest.raises(ConvertError, match=rf"a mixture-of-experts model \({arch}\): (its experts compute|an "
                                           r"architecture leanstream does not know)"):
        _convert(src, tmp_path)
    assert not (tmp_path / "o" / mf.MANIFEST_NAME).exists()


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe", "olmoe", "llama"])
def test_the_moe_families_it_converts(tmp_path, arch):
    src = tmp_path / f"{arch}.gguf"
    write_tiny_model(src, arch=arch, moe_experts=4)
    m = _convert(src, tmp_path)
    assert (m.architecture, m.layers, m.moe.n_expert, m.moe.shared_expert) == (arch, [], 4, arch == "qwen2moe")


def _header(path, arch: str, tensors: dict[str, tuple[int, ...]], n_ff: int | None = None,
            n_expert: int = 0) -> None:
    """A minimal GGUF of architecture ``arch``: one layer of n_embd 32, the given FFN tensors
    (name -> numpy shape: [experts,] rows, row length) in F32; ``n_expert``: an expert count."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    if n_ff is not None:
        w.add_feed_forward_length(n_ff)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(2)
    for name, shape in tensors.items():
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["gpt2", "starcoder", "phi2"])
def test_non_gated_architectures_refused_naming_them(tmp_path, arch):
    """Their FFN is down(act(up x)) (+ biases): no gate for leanstream's down(act(gate x) * up x)."""
    src = tmp_path / f"{arch}.gguf"
    _header(src, arch, {"blk.0.ffn_up.weight": (128, 32), "blk.0.ffn_down.weight": (32, 128)}, n_ff=128)
    with pytest.raises(ConvertError, match=rf"unsupported architecture '{arch}'; leanstream convert supports "
                                           r"llama, qwen2, qwen3, phi3, granite, olmo2, gemma2, gemma3 \(gated"):
        _convert(src, tmp_path)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_gated_architecture_without_ffn_gate_is_refused(tmp_path, arch):
    src = tmp_path / "ng.gguf"
    write_tiny_model(src, arch=arch, gated=False)
    with pytest.raises(ConvertError, match=rf"layer 0 has no ffn_gate: a non-gated FFN \({arch}\) is not supported"):
        _convert(src, tmp_path)


def test_phi3_needs_its_fused_gate_and_up(tmp_path):
    """phi3's ffn_up holds 2 n_ff rows (llama.cpp's phi3 graph splits them): one of n_ff rows, as a
    separate ffn_gate would have, is refused; so is a phi3 without feed_forward_length."""
    assert FUSED_GATE_UP == ("phi3",)
    src = tmp_path / "p.gguf"
    _header(src, "phi3", {"blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64)}, n_ff=64)
    with pytest.raises(ConvertError, match=r"blk.0.ffn_up.weight has shape \[32, 64\], expected \[32, 128\] "
                                           r"\(phi3 holds the gate's and the up's rows in one tensor; n_ff=64\)"):
        _convert(src, tmp_path)
    _header(src, "phi3", {"blk.0.ffn_up.weight": (128, 32), "blk.0.ffn_down.weight": (32, 64)})
    with pytest.raises(ConvertError, match="missing or invalid phi3.feed_forward_length"):
        _convert(src, tmp_path)


def test_every_dense_only_architecture_is_converted():
    assert set(mf.DENSE_ONLY_ARCHS) <= set(mf.ARCH_ACTIVATION) and set(FUSED_GATE_UP) <= set(mf.ARCH_ACTIVATION)


@pytest.mark.parametrize("types", [{"up": "Q4_K", "down": "Q6_K"}, {"ffn": "F16"}, {"ffn": "Q8_0"}],
                         ids=["q4_K_M", "f16", "q8_0"])
def test_phi3_halves_of_any_type(tmp_path, types):
    """The read stage splits the fused ffn_up at a row boundary whatever its type (Phi-3's Q4_K_M
    GGUFs: Q4_K up, Q6_K down; n_embd a multiple of 256): each block file's gate rows are the first
    n_ff rows, its up rows the others, the bytes as stored."""
    src = tmp_path / "phi3.gguf"
    values = write_tiny_model(src, arch="phi3", n_layer=2, n_embd=256, n_ff=256, types=types, seed=2)
    m = _convert(src, tmp_path)
    assert (m.architecture, m.activation, m.n_ff) == ("phi3", "silu", 256)
    for il in range(2):
        w = load_layer(m.layer_path(tmp_path / "o", il))
        fused = values[f"blk.{il}.ffn_up.weight"]
        assert np.array_equal(w.gate, fused[:256]) and np.array_equal(w.up, fused[256:])
