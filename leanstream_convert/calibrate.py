"""The calibrate stage: how much perplexity leanstream mode's sparse decode costs at each
sparsity, measured per domain on the converter's own texts, so that ``quality="ppl+5%"`` can
choose the sparsity that meets the target in the worst domain.

The corpus (`leanstream_convert/data/calibration/`, never the held-out evaluation texts):
- prose: three short essays on bridges, printing and the sky, written for this purpose;
- code: a snapshot of two of this project's own sources (``leanstream_convert/order.py``,
  ``native/src/io.c``): code no model was trained on, like the user's own. Library sources a
  model has memorized hide the cost (CPython's ``shlex.py`` + ``queue.py``, Qwen2.5-Coder-1.5B at
  s = 0.5: x1.009, the project's held-out code x1.015-1.026, held-out prose x1.04-1.05);
- chat: conversations written for this purpose, rendered with the model's own chat template;
- user: the user's ``calibration`` file (text, or .jsonl chats), when given.
The model's own answers were tried first and hide the cost: greedy ones by construction (every
token is the model's first choice: Qwen2.5-1.5B at s = 0.7 x1.02, against x1.13 on held-out
prose), sampled ones still (x1.06).

A table row: {"sparsity", "ppl_ratio", "agreement", "domains": {name: {"ppl_ratio", "agreement"}}}
with the row's ppl_ratio the worst domain's and its agreement the lowest.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from leanstream_ggml.model import manifest as mf
from leanstream_ggml.scoring import windows
from leanstream_ggml.texts import text_tokens

SPARSITIES = (0.3, 0.4, 0.5, 0.6, 0.7)
N_CTX = 256          # one window: 128 tokens of context, 127 scored
N_WINDOWS = 2        # per domain
DATA = Path(__file__).resolve().parent / "data" / "calibration"
DOMAINS = {"prose": DATA / "prose.txt", "code": DATA / "code.txt", "chat": DATA / "chat.jsonl"}


def corpus(user=None) -> dict[str, Path]:
    """{domain: file} of the calibration, the user's file (if any) as domain "user"."""
    out = dict(DOMAINS)
    if user is not None:
        out["user"] = Path(user)
    return out


def window_tokens(llm, path: Path) -> list[list[int]]:
    """The calibration windows of one domain's text (N_WINDOWS of N_CTX tokens; [] if shorter)."""
    tokens, add_bos = text_tokens(llm, path)
    if len(tokens) < N_CTX:
        return []
    return windows(tokens, N_CTX, add_bos, llm.token_bos(), N_WINDOWS)


def _sketch_budget(Llama, out: Path, manifest: mf.Manifest, kw: dict) -> int:
    """A memory budget one block short of the whole FFN (plus what the sketch takes). With a budget
    that holds everything, layers become resident for good after the first prefill and select
    from the exact h of every block, which is better than the sketch's candidates that every
    smaller budget uses; one block short (and with no hot set, calibrate's runs), every op
    selects through the sketch's candidates, so the table holds for any budget."""
    llm = Llama.converting(str(out), manifest, mode="leanstream", **kw)
    try:
        eng = llm.engine
        st = eng.stats()
        stride = max(eng.layer_info(il)["block_stride"] for il in range(eng.n_layers))
        return int(st["cache_capacity"] + st["resident_bytes"] - stride)
    finally:
        llm.close()


def calibrate(out: Path, manifest: mf.Manifest, references: dict, *, memory_limit: int | None = None,
              n_threads: int = 2, progress: bool = True, log=print) -> list[dict]:
    """The quality table (module doc) of leanstream mode against the references the profile
    stage gathered with dense mode (``{domain: [(window, nll, top)]}``, leanstream_convert/activations.py;
    dense reproduces stock llama.cpp within its rounding noise); [] when no domain's text holds
    one window. Under ``memory_limit`` no run's budget exceeds what the plan leaves it."""
    from tqdm import tqdm

    from leanstream_ggml import Llama

    domains = {name: [(list(map(int, w)), (nll, top)) for w, nll, top in refs] for name, refs in references.items() if refs}
    for name in [n for n, refs in references.items() if not refs]:
        log(f"calibrate: the {name} text is shorter than one window of {N_CTX} tokens; left out")
    if not domains:
        return []
    from leanstream_ggml.native.engine import candidate_blocks
    from leanstream_ggml.llama import memory_plan

    from .order import CANDIDATE_RATIO

    # a window's first half is prefilled in one batch, the rest decoded a token at a time
    kw = dict(n_ctx=N_CTX, n_batch=N_CTX // 2, n_threads=n_threads, logits_all=True, verbose=False, speculative="off")
    one_short = _sketch_budget(Llama, out, manifest, kw)
    stride = max(e.block_stride for e in manifest.layers)
    # the plan of these runs counts logits_all's logits: llama-cpp-python's n_ctx rows, and a
    # batch's rows in the graph and in llama.cpp's output buffer
    cap = memory_plan(out, memory_limit, mode="leanstream", manifest=manifest, **kw).budget if memory_limit else None
    table = []
    for s in tqdm(SPARSITIES, desc="calibrating sparse decode", unit="sparsity", disable=not progress):
        # one block short of the FFN (module doc of _sketch_budget); where the candidates are every
        # block (s = 0.3 at 1.5x candidates) the selection is the same with all of them cached, and
        # one short had LRU evict the block read next, re-reading the whole FFN every token
        every = all(candidate_blocks(e.n_blocks, s, CANDIDATE_RATIO) >= e.n_blocks for e in manifest.layers)
        budget = one_short + stride if every else one_short
        if cap is not None:
            budget = min(budget, cap)
        # no hot set: hot blocks are always candidates (scored exactly, their rows are resident),
        # which selects better than the sketch alone; the table holds for the smallest hot set
        llm = Llama.converting(str(out), manifest, mode="leanstream", sparsity=s, hot_fraction=0.0,
                               memory_budget=budget, **kw)
        t0 = time.perf_counter()
        try:
            per = {name: _score(llm, wr) for name, wr in domains.items()}
        finally:
            llm.close()
        if progress:
            log(f"calibrate: sparsity {s:g} in {time.perf_counter() - t0:.0f} s (budget {budget / 2**20:.0f} MiB)")
        table.append({"sparsity": s, "ppl_ratio": max(d["ppl_ratio"] for d in per.values()),
                      "agreement": min(d["agreement"] for d in per.values()), "domains": per})
    return table


def _targets(llm, w: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The next-token NLL and the top-1 token of each scored position of window w, decoded token
    by token (the sparse modes are sparse only for one-token batches), one row of logits at a
    time (a 262k vocabulary's rows, gemma3, would take ~0.5 GB per window at once)."""
    llm.reset()
    split = N_CTX // 2
    llm.eval(w[:split])
    for t in w[split:]:
        llm.eval([t])
    return row_targets((llm.scores[pos] for pos in range(split, N_CTX - 1)), w[split + 1:N_CTX])


def row_targets(rows, nxt) -> tuple[np.ndarray, np.ndarray]:
    """(NLL of nxt[i] under logits row i, argmax of row i), one row at a time (float64)."""
    nll, top = [], []
    for z, t in zip(rows, nxt):
        z = np.asarray(z, dtype=np.float64)
        lse = z.max() + np.log(np.exp(z - z.max()).sum())
        nll.append(lse - z[t])
        top.append(int(z.argmax()))
    return np.asarray(nll), np.asarray(top, np.int64)


def _score(llm, windows_refs) -> dict:
    """Decode-scored perplexity ratio and top-1 agreement of llm against the reference's
    (next-token NLL, top-1) per window."""
    nll_t, nll_r, agree = [], [], []
    for w, (ref_nll, ref_top) in windows_refs:
        nll, top = _targets(llm, w)
        nll_t.append(nll)
        nll_r.append(ref_nll)
        agree.append(top == ref_top)
    ratio = math.exp(float(np.concatenate(nll_t).mean() - np.concatenate(nll_r).mean()))
    return {"ppl_ratio": round(ratio, 4), "agreement": round(float(np.concatenate(agree).mean()), 4)}
