"""Where leanstream's selection loses, per domain and layer (prints JSON lines).

Stock llama.cpp runs each domain's held-out text with the profile capture (leanstream_convert/profile.py:
every layer's normed FFN input x and its exact activations a = act(gate x) * up x). For every
token and layer, in numpy, with the model directory's own sketch rows and down-column norms w:

    oracle      the top n_keep neurons by |a| * w (the best any selection can keep)
    cascade     the sketch's top n_cand (tests/support/reference.py's scorer on x), then the top n_keep
                of those by |a| * w: what the op selects (teacher-forced inputs)

and reports per layer: the cascade's recall of the oracle set, and the FFN output's relative
squared error |sum_dropped a_i d_i|^2 / |sum a_i d_i|^2 (d_i: the dequantized down column) for
oracle and cascade; per domain the share of the error carried by the worst 10 % of tokens.

Layer-ahead speculation (from layer 1 on): while layer n-1 computes, the sketch of layer n scored
with layer n-1's input picks n_cand neurons to prefetch. Per layer: the share of layer n's own
candidates (ahead_recall_cand) and of its kept neurons (ahead_recall_keep) that speculation
picked, against two baselines: the previous token's candidates of the same layer
(prev_token_recall_cand: what a cache of the last token holds) and a random set of the same size
(random_recall = n_cand / n_ff).

    python bench/selection_analysis.py model.lsm source.gguf [--tokens 384] [--sparsity 0.3]
        [--candidate-ratio 1.2] [--domain code=path ...] [--out bench/results/x.jsonl]
"""

from __future__ import annotations

import os
import sys

import numpy as np

import benchkit
from leanstream_tools.texts import HELDOUT


def domain_tokens(vocab_llm, path, n_tokens: int) -> list[int]:
    from leanstream_ggml.texts import text_tokens

    toks, _ = text_tokens(vocab_llm, path)
    return toks[:n_tokens + 1]


def capture(src: str, token_lists: dict[str, list[int]], n_threads: int, chunk: int = 256):
    """{domain: {il: (x [T, n_embd], a [T, n_ff])}} from stock llama.cpp (first 8 positions of a
    chunk dropped: no context yet)."""
    from leanstream_convert.profile import Profiler

    out = {}
    with Profiler(src, n_ctx=chunk, n_threads=n_threads) as prof:
        for name, toks in token_lists.items():
            xs: dict[int, list] = {}
            for i in range(0, len(toks) - 8, chunk):
                got = prof.run(toks[i:i + chunk])
                for il in range(prof.n_layer):
                    xs.setdefault(il, []).append((got[("ffn_norm", il)][8:], got[("ffn_swiglu", il)][8:]))
            out[name] = {il: (np.concatenate([p[0] for p in v]), np.concatenate([p[1] for p in v]))
                         for il, v in xs.items()}
    return out


def sketch_scores(gate_rows, up_rows, x: np.ndarray, act) -> np.ndarray:
    """[T, n_rows] |act(g~) u~| of the sketch rows (tests/support/reference.py's scorer, batched); with
    up_rows None, |act(g~)| (the gate-only scorer)."""
    from tests.support.reference import dequantize_rows, round_x

    n = x.shape[1]
    xr = np.stack([round_x(v) for v in x]).astype(np.float32)
    g = xr @ dequantize_rows(gate_rows, n).T
    if up_rows is None:
        return np.abs(act(g))
    u = xr @ dequantize_rows(up_rows, n).T
    return np.abs(act(g) * u)


def topk_mask(score: np.ndarray, k: int) -> np.ndarray:
    idx = np.argpartition(-score, k - 1, axis=1)[:, :k]
    m = np.zeros(score.shape, bool)
    np.put_along_axis(m, idx, True, axis=1)
    return m


def cascade_keep(sk: np.ndarray, imp: np.ndarray, n_cand: int, n_keep: int) -> np.ndarray:
    """Kept mask: the top n_keep by imp among the top n_cand by sk."""
    cand = np.argpartition(-sk, n_cand - 1, axis=1)[:, :n_cand]
    top = np.argpartition(-np.take_along_axis(imp, cand, axis=1), n_keep - 1, axis=1)[:, :n_keep]
    keep = np.zeros(sk.shape, bool)
    np.put_along_axis(keep, np.take_along_axis(cand, top, axis=1), True, axis=1)
    return keep


def rel_error(a: np.ndarray, down: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Per token: |sum over dropped neurons of a_i d_i|^2 / |sum of a_i d_i|^2."""
    full = a @ down
    drop = (a * ~keep) @ down
    return (drop.astype(np.float64) ** 2).sum(1) / np.maximum((full.astype(np.float64) ** 2).sum(1), 1e-30)


def ahead_recall(sk_ahead: np.ndarray, sk: np.ndarray, keep: np.ndarray, n_cand: int) -> dict:
    """Layer-ahead speculation's recall (module doc) from the layer's sketch scores on the layer
    before's input (sk_ahead) and on its own (sk), and its kept mask, all [T, n_ff]."""
    spec, cand = topk_mask(sk_ahead, n_cand), topk_mask(sk, n_cand)
    return {"ahead_recall_cand": float((spec & cand).sum() / cand.sum()),
            "ahead_recall_keep": float((spec & keep).sum() / keep.sum()),
            "prev_token_recall_cand": float((cand[:-1] & cand[1:]).sum() / cand[1:].sum()),
            "random_recall": n_cand / sk.shape[1]}


def main() -> int:
    ap = benchkit.parser(__doc__)
    ap.add_argument("model")
    ap.add_argument("source")
    ap.add_argument("--tokens", type=int, default=384, help="tokens per domain")
    benchkit.flags(ap, "sparsity", "candidate_ratio", defaults={"sparsity": 0.3, "candidate_ratio": 1.2})
    ap.add_argument("--domain", action="append", default=[], metavar="NAME=PATH",
                    help="domains to analyse (default: the held-out prose, code and chat)")
    ap.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import llama_cpp

    from leanstream_convert import sketch
    from leanstream_ggml.model import manifest
    from leanstream_ggml.native.engine import candidate_blocks, kept_blocks
    from tests.support.reference import act as act_fn, load_layer

    domains = dict(d.split("=", 1) for d in a.domain) if a.domain else {k: str(v) for k, v in HELDOUT.items()}
    m = manifest.load(a.model)
    voc = llama_cpp.Llama(a.source, vocab_only=True, verbose=False)
    toks = {k: domain_tokens(voc, p, a.tokens) for k, p in domains.items()}
    voc.close()
    cap = capture(a.source, toks, a.threads)
    act = lambda z: act_fn(z, m.activation)   # noqa: E731
    emit = benchkit.Lines(a.out)

    per_token = {k: [] for k in domains}
    prev_x = {}   # domain -> layer n-1's input
    for il in range(m.n_layer):
        lw = load_layer(m.layer_path(a.model, il))
        perm = lw.perm
        down = lw.down[perm]                                 # file order
        _, gate_rows, up_rows, w = sketch.read(m.resolve(a.model, m.sketch.files[il]))
        n = len(perm)
        if lw.k != 1:
            raise SystemExit("selection_analysis: one neuron per block only (convert with --k 1)")
        n_keep, n_cand = kept_blocks(n, a.sparsity), candidate_blocks(n, a.sparsity, a.candidate_ratio)
        for name in domains:
            x, act_a = cap[name][il]
            af = act_a[:, perm]                              # file order, like the sketch rows
            imp = np.abs(af) * w
            sk = sketch_scores(gate_rows, up_rows, x, act) * w
            oracle = topk_mask(imp, n_keep)
            keep = cascade_keep(sk, imp, n_cand, n_keep)
            e_o, e_c = rel_error(af, down, oracle), rel_error(af, down, keep)
            per_token[name].append(e_c)
            # (an oracle neuron among the candidates is always kept: recall = the candidates' recall)
            row = {"layer": il, "domain": name, "recall": float((keep & oracle).sum() / oracle.sum()),
                   "err_oracle": float(e_o.mean()), "err_cascade": float(e_c.mean()),
                   "n_tokens": int(len(x))}
            if name in prev_x:
                row.update(ahead_recall(sketch_scores(gate_rows, up_rows, prev_x[name], act) * w, sk, keep, n_cand))
            prev_x[name] = x
            emit(row)
    for name, v in per_token.items():
        tot = np.sum(v, axis=0)                                # per token, summed over layers
        worst = np.sort(tot)[::-1][: max(1, len(tot) // 10)]
        emit({"domain": name, "err_cascade_mean": float(tot.mean() / m.n_layer),
              "worst10_share": float(worst.sum() / tot.sum()),
              "sparsity": a.sparsity, "ratio": a.candidate_ratio})
    emit.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
