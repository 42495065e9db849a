"""Quality / bytes frontier of sparse decode, decode-scored on held-out text (prints JSON lines).

For every (mode, sparsity, candidate_ratio) the model is opened at a 100 % budget (quality only;
at that budget leanstream's layers become resident after the first prefill and select from the
exact h of every block, "method" says so; --memory-budget below the FFN's size measures the
sketch's candidates),
the second half of each window is decoded token by token, and compared with stock
llama-cpp-python on the source GGUF over the same windows (reference logits computed once):
perplexity ratio, top-1 agreement, mean KL, and from the engine's counters the fraction of dense
mode's FFN bytes a token computes with (gate/up of every candidate + down of the kept blocks),
the sketch's resident MB and the scorer's time per layer and token.

    python bench/sparse_quality.py model.lsm source.gguf --sparsity 0.3 0.5 --candidate-ratio 1.25 1.5 \
        [--mode leanstream] [--ctx 512 --chunks 2] [--out bench/results/x.jsonl]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import benchkit
from leanstream_ggml.native import modes
from leanstream_ggml.scoring import log_softmax, scored_range, window_logits, windows
from leanstream_ggml.texts import text_tokens
from leanstream_tools.bench import DEFAULT_TEXT
from leanstream_tools.measure import machine_info


def reference_windows(gguf: str, text_path, n_ctx: int, chunks: int, n_threads: int):
    import llama_cpp

    ref = llama_cpp.Llama(gguf, n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads, logits_all=True, verbose=False)
    tokens, add_bos = text_tokens(ref, text_path)
    ws = windows(tokens, n_ctx, add_bos, ref.token_bos(), chunks)
    pos = np.array(scored_range(n_ctx))
    out = [(w, log_softmax(window_logits(ref, w)[pos]).astype(np.float32)) for w in ws]
    ref.close()
    return out


def decode_window(llm, w: list[int], totals: dict) -> np.ndarray:
    """window_logits(decode=True), with the engine's counters of the decoded tokens only
    (prefill is dense) added to totals."""
    split = scored_range(len(w)).start
    llm.reset()
    llm.eval(w[:split])
    llm.reset_stats()
    for t in w[split:]:
        llm.eval([t])
    for k, v in llm.stats().items():
        if isinstance(v, int):
            totals[k] = totals.get(k, 0) + v
    return np.array(llm.scores[:len(w)], dtype=np.float32, copy=True)


def score(llm, refs, n_ctx: int, totals: dict) -> dict:
    pos = np.array(scored_range(n_ctx))
    nll_t, nll_r, agree, kl = [], [], [], []
    for w, lpr in refs:
        lpt = log_softmax(decode_window(llm, w, totals)[pos])
        nxt = np.asarray(w)[pos + 1]
        nll_t.append(-lpt[np.arange(len(pos)), nxt])
        nll_r.append(-lpr[np.arange(len(pos)), nxt])
        agree.append(lpt.argmax(-1) == lpr.argmax(-1))
        kl.append((np.exp(lpr) * (lpr - lpt)).sum(-1))
    t, r = np.concatenate(nll_t), np.concatenate(nll_r)
    return {"ppl": float(np.exp(t.mean())), "ppl_reference": float(np.exp(r.mean())),
            "ppl_ratio": float(np.exp(t.mean() - r.mean())), "top1_agreement": float(np.concatenate(agree).mean()),
            "kl_mean": float(np.concatenate(kl).mean()), "n_scored": int(t.size)}


def main() -> int:
    ap = benchkit.parser(__doc__)
    ap.add_argument("model")
    ap.add_argument("reference")
    # (sparsity, candidate ratio: the engine's defaults unless given; the budget: all, quality only)
    benchkit.flags(ap, "mode", "sparsity", "candidate_ratio", "memory_budget",
                   sweep=("mode", "sparsity", "candidate_ratio"), defaults={"mode": [modes.QUALITY]})
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--text", default=str(DEFAULT_TEXT), help="held-out text, or .jsonl chats (leanstream_ggml/texts.py)")
    ap.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file")
    a = ap.parse_args()

    from leanstream_ggml import Llama
    from leanstream_ggml.model import manifest

    m = manifest.load(a.model)
    dense_bytes = sum(e.n_blocks * e.block_payload for e in m.layers)   # per token, dense mode
    n_blocks = sum(e.n_blocks for e in m.layers)
    refs = reference_windows(a.reference, a.text, a.ctx, a.chunks, a.threads)
    emit = benchkit.Lines(a.out)
    for mode in a.mode:
        cascade = bool(modes.is_cascade(mode) and m.sketch)
        for s in a.sparsity or [None]:
            for ratio in (a.candidate_ratio or [None]) if cascade else [None]:
                kw = dict(mode=mode, n_ctx=a.ctx, n_batch=a.ctx, n_threads=a.threads, logits_all=True, verbose=False)
                if modes.is_sparse(mode):
                    kw["sparsity"] = s
                if cascade:
                    kw["candidate_ratio"] = ratio
                if a.memory_budget:
                    kw["memory_budget"] = a.memory_budget
                llm = Llama(a.model, **kw)
                t0 = time.perf_counter()
                st = {}
                row = score(llm, refs, a.ctx, st)
                dec_tokens = max(1, st["tokens"])
                resident = llm.stats()["resident_bytes"]
                row.update({
                    "model": Path(a.model).name, "text": Path(a.text).name, "mode": mode,
                    "sparsity": round(llm.sparsity, 6) if modes.is_sparse(mode) else 0.0,
                    "candidate_ratio": round(llm.engine.candidate_ratio, 6) if cascade else None,
                    "memory_budget": a.memory_budget,
                    "bytes_read_fraction": st["bytes_read"] / dec_tokens / dense_bytes,
                    "method": ("resident layers: exact h of every block->down"
                               if cascade and st["blocks_candidates"] >= n_blocks * dec_tokens else
                               "sketch->candidates->exact h->down" if cascade else
                               "layer-ahead predictor" if modes.is_sparse(mode) else "dense"),
                    "bytes_fraction": st["bytes_computed"] / dec_tokens / dense_bytes,
                    "resident_MB": resident / 1e6,
                    "ffn_MB": dense_bytes / 1e6,
                    "scorer_ms_per_layer_token": (st["scorer_ns"] / 1e6 / m.n_layer / dec_tokens
                                                  if st["blocks_candidates"] else None),
                    "spec_recall": st["spec_hits"] / st["spec_selected"] if st["spec_selected"] else None,
                    "decoded_tokens": st["tokens"], "seconds": time.perf_counter() - t0,
                    "load1": os.getloadavg()[0],
                })
                llm.close()
                emit(row)
    emit.close()
    print(json.dumps({"machine": machine_info()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
