"""The mixture-of-experts families leanstream runs, as data: what each llama.cpp architecture's
routed experts compute, one row per architecture (docs/moe-families.md has the reading of
llama.cpp behind it).

Patch 0005 hooks llama.cpp's ``build_moe_ffn`` after the router has chosen and weighted the
experts, so everything around the experts (attention of any kind, recurrent layers, routers and
their biases, expert groups, shared experts, dense layers, MTP layers) stays llama.cpp's. What a
family does differently is only what one routed expert computes, and that is a row here:

    activation     build_moe_ffn's type_op for the family: "silu" (SwiGLU), "gelu" (GeGLU),
                   "relu" (ReGLU), "swiglu_oai" (gpt-oss: clamped, alpha 1.702, limit 7)
    weight_before  the router's weights scale each expert's input, not its output (llama4)

Per-expert biases (``ffn_*_exps.bias``), per-expert scales (``ffn_*_exps.scale``), gate and up
fused in one tensor (``ffn_gate_up_exps``), leading dense, interleaved and MTP layers are read
from the GGUF itself (leanstream_convert/moe_source.py), whatever the family.

An architecture not in ``FAMILIES`` is refused by the converter (leanstream_convert/moe_source.py:
``REFUSED`` says what the ones known to compute their experts otherwise lack).
"""

from __future__ import annotations

from dataclasses import dataclass

EXPERT_ACTIVATIONS = ("silu", "gelu", "relu", "swiglu_oai")


@dataclass(frozen=True)
class ExpertFn:
    """What one routed expert of a family computes (the module's docstring)."""
    activation: str = "silu"
    weight_before: bool = False


SILU = ExpertFn()

# every architecture of llama.cpp (llama-cpp-python 0.3.36) whose graph calls build_moe_ffn with
# gated experts under standard tensor names; "llama" and "qwen2" are Mixtral-style files (an
# expert count); the tested ones are in README.md's families table
FAMILIES: dict[str, ExpertFn] = {
    **dict.fromkeys((
        "llama", "qwen2", "qwen2moe", "qwen3moe", "qwen3vlmoe", "olmoe", "phimoe", "dbrx", "mellum",
        "llada-moe", "rnd1", "granite", "granitemoe", "granitehybrid", "minicpm", "mistral3", "hunyuan-moe",
        "minimax-m2", "minimax-01", "deepseek", "deepseek2", "deepseek2-ocr", "deepseek32", "glm4moe", "glm-dsa",
        "dots1", "dots3note", "exaone-moe", "bailingmoe", "bailingmoe2", "afmoe", "laguna", "cohere2moe",
        "ernie4_5-moe", "hy_v3", "lfm2moe", "qwen3next", "qwen35moe", "qwen4exp", "jamba", "kimi-linear",
        "mimo2", "arctic",
    ), SILU),
    "grok": ExpertFn(activation="gelu"),
    "gemma4": ExpertFn(activation="gelu"),
    "smallthinker": ExpertFn(activation="relu"),
    "gpt-oss": ExpertFn(activation="swiglu_oai"),
    "minimax-m3": ExpertFn(activation="swiglu_oai"),
    "llama4": ExpertFn(weight_before=True),
}
