"""A mixture-of-experts model directory under ``Llama`` (docs/design.md §24).

llama.cpp computes everything of base.gguf as stock does, the router included (its logits,
softmax or sigmoid, top-k, the weights' normalization and scaling) and a shared expert with its
gate; the routed experts of every layer stream from the expert files through the native MoE op
(moe.MoEEngine, native/src/moe.c), which llama.cpp's MoE hook (patches/0005) hands the selected
experts and their weights. The sparsity is the router's own, so there is one mode, dense (every
expert a token is routed to, exactly), and the options that shape sparse decoding do not apply.

What this module decides for ``Llama``: which options a MoE model takes (``moe_options``), the
engine over its expert files with the budget the plan gave it and its hot set (``open_engine``).
"""

from __future__ import annotations

from pathlib import Path

from leanstream_ggml.native import modes
from leanstream_ggml.native.moe import MoEEngine

# what speculation a MoE model runs: prompt lookup (its drafts cost nothing; the verify pass reads
# the union of its rows' experts once). The self draft from RAM-resident experts is not built yet.
SPECULATION = ("auto", "ngram", "off")


def moe_options(o: dict, given: dict) -> None:
    """Check (ValueError naming the option) and settle, in place, the options of a MoE model."""
    if modes.is_sparse(o["mode"]):
        raise ValueError(f"mode={o['mode']!r}: a mixture-of-experts model runs in dense mode (a token reads "
                         f"only the experts its router picks: the sparsity is exact already)")
    if o["speculative"] not in SPECULATION:
        raise ValueError(f"speculative={o['speculative']!r}: on a mixture-of-experts model speculation drafts by "
                         f"prompt lookup (speculative='ngram', what 'auto' runs) or is off")
    if o["speculative"] == "auto":
        o["speculative"] = "ngram"
    if given.get("controller") not in (None, "off"):
        raise ValueError("controller: the streaming controller steers the dense FFN's reads; a mixture-of-experts "
                         "model reads whole experts")


def open_engine(m, model_dir: Path, o: dict) -> MoEEngine:
    """The routed experts' engine over the manifest's expert files, its cache the engine's budget
    (o["memory_budget"]: the memory plan's, or the user's; None: every expert once read)."""
    return MoEEngine([m.resolve(model_dir, e.file) for e in m.moe.layers], cache_bytes=o["memory_budget"] or 0,
                     activation=m.activation, n_io_threads=o["n_io_threads"],
                     verify_checksums=o["verify_checksums"])
