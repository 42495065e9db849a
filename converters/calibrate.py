"""The calibrate stage: how much perplexity leanstream mode's sparse decode costs at each
sparsity, measured on the model's own text, so that ``quality="ppl+5%"`` can choose the sparsity.

The text is the converter's own: `converters/data/calibration.txt` (three short essays on
bridges, printing and the sky, written for this purpose; never the held-out evaluation text), or
the user's ``calibration`` text. The model's own answers were tried first and hide the cost:
greedy ones by construction (every token is the model's first choice: Qwen2.5-1.5B at s = 0.7
x1.02, against x1.13 on held-out prose), sampled ones still (x1.06).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from leanstream_ggml import manifest as mf

SPARSITIES = (0.3, 0.4, 0.5, 0.6, 0.7)
N_CTX = 256          # one window: 128 tokens of context, 127 scored
N_WINDOWS = 3
TEXT = Path(__file__).resolve().parent / "data" / "calibration.txt"


def _windows(llm, text: str) -> list[list[int]]:
    from leanstream_ggml.harness.perplexity import tokenize_for_perplexity, windows

    tokens, add_bos = tokenize_for_perplexity(llm, text)
    if len(tokens) < N_CTX:
        return []
    return windows(tokens, N_CTX, add_bos, llm.token_bos(), N_WINDOWS)


def _logits(llm, w: list[int], decode: bool) -> np.ndarray:
    from leanstream_ggml.harness.perplexity import log_softmax, window_logits

    pos = np.arange(N_CTX // 2, N_CTX - 1)
    return log_softmax(window_logits(llm, w, decode=decode)[pos])


def _sketch_budget(Llama, out: Path, manifest: mf.Manifest, kw: dict) -> int:
    """A memory budget one block short of the whole FFN (plus what the sketch takes). With a budget
    that holds everything, layers become resident for good after the first prefill and select
    from the exact h of every block, which is better than the sketch's candidates that every
    smaller budget uses; one block short, every op selects through the sketch, so the table
    holds for any budget."""
    llm = Llama(str(out), mode="leanstream", _manifest=manifest, **kw)
    try:
        eng = llm._engine
        st = eng.stats()
        stride = max(eng.layer_info(il)["block_stride"] for il in range(eng.n_layers))
        return int(st["cache_capacity"] + st["resident_bytes"] - stride)
    finally:
        llm.close()


def calibrate(src: Path, out: Path, manifest: mf.Manifest, *, text_path=None, n_threads: int = 2,
              progress: bool = True, log=print) -> list[dict]:
    """[{"sparsity", "ppl_ratio", "agreement"}] of leanstream mode vs stock on the calibration text."""
    import llama_cpp
    from tqdm import tqdm

    from leanstream_ggml import Llama

    kw = dict(n_ctx=N_CTX, n_batch=N_CTX, n_threads=n_threads, logits_all=True, verbose=False)
    stock = llama_cpp.Llama(str(src), **kw)
    try:
        ws = _windows(stock, Path(text_path or TEXT).read_text(encoding="utf-8"))
        refs = [_logits(stock, w, decode=False) for w in ws]
    finally:
        stock.close()
    if not ws:
        log("calibrate: the calibration text is shorter than one window; no quality table (use sparsity=)")
        return []
    budget = _sketch_budget(Llama, out, manifest, kw)
    table = []
    for s in tqdm(SPARSITIES, desc="calibrating sparse decode", unit="sparsity", disable=not progress):
        llm = Llama(str(out), mode="leanstream", sparsity=s, memory_budget=budget, _manifest=manifest, **kw)
        try:
            nll_t, nll_r, agree = [], [], []
            for w, lr in zip(ws, refs):
                lt = _logits(llm, w, decode=True)
                nxt = np.asarray(w)[N_CTX // 2 + 1:N_CTX]
                idx = np.arange(len(nxt))
                nll_t.append(-lt[idx, nxt])
                nll_r.append(-lr[idx, nxt])
                agree.append(lt.argmax(-1) == lr.argmax(-1))
        finally:
            llm.close()
        ratio = math.exp(float(np.concatenate(nll_t).mean() - np.concatenate(nll_r).mean()))
        table.append({"sparsity": s, "ppl_ratio": round(ratio, 4),
                      "agreement": round(float(np.concatenate(agree).mean()), 4)})
    return table
