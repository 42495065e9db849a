"""Every mixture-of-experts family of the issue, on its own layout (tests/support/moe_families.py,
moe_hybrids.py: tiny GGUFs in each architecture's tensor names, shapes and metadata, which stock
llama.cpp loads), converted with the default `leanstream convert` and run by Llama with the routed
experts streamed through a cache smaller than one layer's experts.

What is compared, teacher-forced over the same tokens on the same file: stock llama-cpp-python
with flash attention (as Llama runs) against stock without it is stock's own rounding noise, and
so is stock's batch against stock decoding the same tokens one at a time (the rows Llama
computes: its exact rows round a verify pass's rows as plain decoding's). Llama against stock's
batch must stay within twice the larger of the two, in mean and median KL (a floor of 1e-6 where
both are zero), with every argmax equal; against stock's decoding its logits are equal bit for
bit. In RAM, greedy answers equal stock's; greedy `auto` speculation equals `off` (on a recurrent
model `auto` drafts nothing, and says why)."""

from __future__ import annotations

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
from moe_families import write_family  # noqa: E402
from moe_hybrids import write_hybrid  # noqa: E402

# family: (writer, its keyword arguments)
CASES = {
    "gpt-oss": (write_family, {"arch": "gpt-oss"}),
    "glm4moe": (write_family, {"arch": "glm4moe"}),
    "glm4moe-mtp": (write_family, {"arch": "glm4moe", "nextn": 1}),
    "deepseek2": (write_family, {"arch": "deepseek2"}),
    "deepseek2-fused": (write_family, {"arch": "deepseek2", "fused_gate_up": True}),
    "llama4": (write_family, {"arch": "llama4"}),
    "ernie4_5-moe": (write_family, {"arch": "ernie4_5-moe"}),
    "granitemoe": (write_family, {"arch": "granitemoe"}),
    "dots1": (write_family, {"arch": "dots1"}),
    "gemma4": (write_family, {"arch": "gemma4"}),
    "gemma4-fused": (write_family, {"arch": "gemma4", "fused_gate_up": True}),
    "qwen3next": (write_hybrid, {"arch": "qwen3next"}),
    "qwen3next-fused": (write_hybrid, {"arch": "qwen3next", "fused_gate_up": True}),
    "qwen35moe": (write_hybrid, {"arch": "qwen35moe"}),
    "lfm2moe": (write_hybrid, {"arch": "lfm2moe"}),
}
N_TOKENS = 48
KL_FLOOR = 1e-6


def _tokens(seed: int = 7) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, N_TOKENS)]


def _log_softmax(a):
    a = a - a.max(-1, keepdims=True)
    return a - np.log(np.exp(a).sum(-1, keepdims=True))


def _kl(ref, got) -> np.ndarray:
    lp, lq = _log_softmax(ref), _log_softmax(got)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def _stock_scores(src, toks, flash: bool, n_batch: int = 512) -> np.ndarray:
    llm = llama_cpp.Llama(str(src), n_ctx=128, logits_all=True, verbose=False, n_threads=2, flash_attn=flash,
                          n_batch=n_batch, n_ubatch=n_batch)
    try:
        llm.eval(toks)
        return np.array(llm.scores[:len(toks)], dtype=np.float64)
    finally:
        llm.close()


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    """(case, the writer's info, source GGUF, model directory) converted by the command line's defaults."""
    from leanstream_ggml.cli import main

    writer, kw = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    src = d / "src.gguf"
    info = writer(src, seed=3, **kw)
    assert main(["convert", str(src), str(d / "model.lsm"), "--quiet"]) == 0
    return request.param, info, src, d / "model.lsm"


def _small_cache(model) -> int:
    """Five experts' bytes: fewer than one layer's experts."""
    from leanstream_ggml.model import manifest

    m = manifest.load(model)
    return 5 * max(e.expert_stride for _, e in m.moe.expert_layers())


def test_the_conversion_keeps_llama_cpp_s_layers(family):
    """An expert file for each MoE layer, none for dense or MTP layers; base.gguf keeps what
    llama.cpp computes itself and none of the routed experts."""
    import gguf

    from leanstream_ggml.model import manifest

    case, info, src, model = family
    m = manifest.load(model)
    have = [il for il, _ in m.moe.expert_layers()]
    assert have == [il for il in info["moe_layers"] if il not in info.get("mtp_layers", [])]
    assert m.moe.mtp_layers == list(info.get("mtp_layers", []))
    base = {t.name for t in gguf.GGUFReader(model / "base.gguf").tensors}
    assert not any("_exps." in n for n in base)
    source = {t.name for t in gguf.GGUFReader(src).tensors}
    assert base == {n for n in source if "_exps." not in n}
    for il in info.get("dense_layers", []):
        assert m.moe.layers[il] is None
        assert any(n.startswith(f"blk.{il}.ffn_") for n in base), f"layer {il}'s dense FFN stays in base.gguf"


def test_streamed_logits_sit_within_stock_s_own_noise(family):
    from leanstream_ggml import Llama

    case, _, src, model = family
    toks = _tokens()
    ref = _stock_scores(src, toks, flash=True)
    noise = _kl(ref, _stock_scores(src, toks, flash=False))
    # stock computing each row as decoding that token alone does (what Llama's exact rows do: a
    # verify pass's rows round as plain decoding's), and its own difference from the batch
    rows = _stock_scores(src, toks, flash=True, n_batch=1)
    batch_noise = _kl(ref, rows)
    llm = Llama(str(model), n_ctx=128, logits_all=True, verbose=False, n_threads=2,
                memory_budget=_small_cache(model), speculative="off")
    assert llm.backend == "stream" and llm.manifest.moe is not None
    llm.eval(toks)
    got = np.array(llm.scores[:len(toks)], dtype=np.float64)
    s = llm.stats()
    llm.close()
    kl, kl_rows = _kl(ref, got), _kl(rows, got)
    assert s["cache_slots"] < llm.manifest.moe.n_expert and s["misses"] > 0, s   # streamed
    print(f"\n{case}: KL mean {kl.mean():.3g} median {np.median(kl):.3g}; stock's own (flash) mean {noise.mean():.3g} "
          f"median {np.median(noise):.3g}, (batch) mean {batch_noise.mean():.3g}; against stock's rows "
          f"{kl_rows.mean():.3g}; argmax agreement {(ref.argmax(-1) == got.argmax(-1)).mean():.3f}")
    assert (ref.argmax(-1) == got.argmax(-1)).all()
    for stat in (np.mean, np.median):
        own = max(stat(noise), stat(batch_noise))   # (lfm2moe: the batch's, 3.7x the flash one's)
        assert stat(kl) <= max(2 * own, KL_FLOOR), (case, stat.__name__, float(stat(kl)), float(own))
    # and Llama's rows are stock's decoding rows, bit for bit
    assert np.array_equal(got, rows), (case, float(np.abs(got - rows).max()))


def test_in_ram_greedy_equals_stock_and_auto_equals_off(family):
    from leanstream_ggml import Llama

    case, info, src, model = family
    prompt = _tokens(11)[:12]
    stock = llama_cpp.Llama(str(src), n_ctx=128, verbose=False, n_threads=2, flash_attn=True)
    want = [t for _, t in zip(range(16), stock.generate(prompt, temp=0.0, top_k=1))]
    stock.close()
    got = {}
    for spec in ("off", "auto"):
        llm = Llama(str(model), n_ctx=128, verbose=False, n_threads=2, speculative=spec, in_ram="stream")
        got[spec] = [t for _, t in zip(range(16), llm.generate(prompt, temp=0.0, top_k=1))]
        stats = llm.stats()
        assert llm.backend == "stream"
        llm.close()
    assert got["off"] == want, case
    assert got["auto"] == got["off"], case
    assert "speculative" in stats or stats["speculative_reason"].startswith(f"off: {info['arch']} keeps a recurrent state")


def test_a_family_whose_experts_the_op_cannot_compute_is_refused_saying_what_it_lacks(tmp_path):
    """nemotron_h_moe (ungated ReLU² experts behind a latent projection) in its own layout, which
    stock llama.cpp loads: the converter refuses it, naming what its experts compute, and writes
    nothing."""
    from leanstream_ggml.cli import main

    write_hybrid(tmp_path / "src.gguf", "nemotron_h_moe", seed=3)
    assert main(["convert", str(tmp_path / "src.gguf"), str(tmp_path / "model.lsm"), "--quiet"]) == 1
    assert not (tmp_path / "model.lsm" / "manifest.json").exists()
    from leanstream_convert import ConvertError, convert

    with pytest.raises(ConvertError, match=r"a mixture-of-experts model \(nemotron_h_moe\): its experts compute "
                                           r"ungated ReLU² experts \(ffn_up_exps and ffn_down_exps, no gate\)"):
        convert(tmp_path / "src.gguf", tmp_path / "o", progress=False)
