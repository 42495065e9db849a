"""The allocate stage: how many candidates each layer's sketch needs, at the same total.

leanstream mode computes gate/up exactly for the top ``candidate_ratio x kept`` neurons by sketch
score and keeps the best ``kept`` of them; a neuron the best keep set needs but the sketch ranks
below the candidates is lost. How often that happens differs by layer, not by domain: on
Qwen2.5-Coder-1.5B (held-out prose, code and chat, s = 0.5, 1.5x candidates) the sketch's recall
of the best keep set is 0.89-0.92 in layers 2-5 and 0.94-0.95 elsewhere, and there the loss is
3-6x the best keep set's own against 1.5-1.7x in later layers (bench/selection_analysis.py).

So the converter measures, on its calibration corpus (stock llama.cpp's own activations, the
profile capture of converters/profile.py; the engine's native sketch scorer on the same inputs),
per layer and candidate ratio r in RATIOS the share of sum a^2 that the cascade drops beyond what
the best keep set drops (a = act(gate x) * up x, the quantity the op ranks by), and gives the
candidates to the layers where they remove the most loss for the default ratio's bytes of gate/up
rows (the least summed loss at that total: a multiple-choice knapsack, solved exactly). The result
is a factor per layer on candidate_ratio (the manifest's ``sketch.candidate_scale``, mean 1 when
the layers are alike): a user's candidate_ratio scales every layer's share alike.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

RATIOS = (1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0)
SPARSITY = 0.5               # the default sparsity, which the allocation is made for
RATIO = 1.5                  # LS_DEFAULT_CANDIDATE_RATIO: the bytes the allocation spends
N_CTX = 256
TOKENS_PER_DOMAIN = 240      # kept positions (the first SKIP of a chunk have little context)
SKIP = 8


def excess_loss(imp: np.ndarray, score: np.ndarray, n_keep: int, n_cands: list[int]) -> np.ndarray:
    """[len(n_cands)] mean over tokens of the share of sum imp^2 that keeping the best n_keep of
    the top n_cand by score drops beyond what the best n_keep by imp drop. imp, score [T, n]."""
    e = imp.astype(np.float64) ** 2
    total = np.maximum(e.sum(1), 1e-30)
    best = _top_sum(e, n_keep)
    order = np.argsort(-score, axis=1, kind="stable")
    out = []
    for n_cand in n_cands:
        cand = np.take_along_axis(e, order[:, :n_cand], axis=1)
        kept = _top_sum(cand, n_keep)
        out.append(float(((best - kept) / total).mean()))
    return np.array(out)


def _top_sum(e: np.ndarray, k: int) -> np.ndarray:
    """Per row, the sum of the k largest values."""
    if k >= e.shape[1]:
        return e.sum(1)
    return np.partition(e, e.shape[1] - k, axis=1)[:, e.shape[1] - k:].sum(1)


def allocate(loss: np.ndarray, n_cand: np.ndarray, row_bytes: np.ndarray, budget: int) -> np.ndarray:
    """Per layer, the index into RATIOS that minimizes the summed loss with at most ``budget``
    bytes of candidates: loss [L, R], n_cand [L, R] candidates, row_bytes [L] gate/up bytes per
    candidate (integers). Exact: a multiple-choice knapsack by dynamic programming over the budget
    in units of the costs' greatest common divisor."""
    L, R = loss.shape
    cost = np.asarray(n_cand, np.int64) * np.asarray(row_bytes, np.int64)[:, None]     # [L, R] bytes
    g = int(np.gcd.reduce(np.append(cost.reshape(-1), int(budget))))
    cost //= g
    units = int(budget) // g
    inf = np.inf
    best = np.zeros(units + 1)                 # best[b]: least loss of the layers so far within b units
    choice = np.zeros((L, units + 1), np.int8)
    for il in range(L):
        new = np.full(units + 1, inf)
        for j in range(R):
            c = cost[il, j]
            if c > units:
                continue
            cand = np.full(units + 1, inf)
            cand[c:] = best[:units + 1 - c] + loss[il, j]
            better = cand < new
            new[better] = cand[better]
            choice[il, better] = j
        best = new
    if not np.isfinite(best[units]):
        raise ValueError("no choice of candidates fits the budget")
    at, b = np.zeros(L, np.int64), units
    for il in range(L - 1, -1, -1):            # walk the choices back
        at[il] = choice[il, b]
        b -= cost[il, at[il]]
    return at


def candidate_scales(src, out: Path, manifest, corpus: dict[str, Path], *, n_threads: int = 2,
                     progress: bool = True, log=print) -> dict:
    """{"scale": [n_layer] factors on candidate_ratio, "loss_before", "loss_after"} (module doc)."""
    import llama_cpp
    from tqdm import tqdm

    from leanstream_ggml.engine import FFNEngine, candidate_blocks, kept_blocks
    from leanstream_ggml.harness.texts import text_tokens

    from .profile import Profiler

    voc = llama_cpp.Llama(str(src), vocab_only=True, verbose=False)
    try:
        token_lists = [text_tokens(voc, p)[0][:TOKENS_PER_DOMAIN + SKIP] for p in corpus.values()]
    finally:
        voc.close()
    m = manifest
    eng = FFNEngine([m.resolve(out, e.file) for e in m.layers], activation=m.activation, mode="leanstream",
                    sketch_paths=[m.resolve(out, f) for f in m.sketch.files], verify_checksums=False)
    n_layer = m.n_layer
    xs = [[] for _ in range(n_layer)]
    imps = [[] for _ in range(n_layer)]
    perms = list(_perms(out, m))
    weights = [_sketch_weight(out, m, il) for il in range(n_layer)]
    if any(e.n_blocks != m.n_ff for e in m.layers):
        raise ValueError("the allocation needs one neuron per block")
    with Profiler(src, n_ctx=N_CTX, n_threads=n_threads) as prof:
        for toks in tqdm(token_lists, desc="profiling candidate recall", unit="domain", disable=not progress):
            if len(toks) <= SKIP + 1:
                continue
            got = prof.run(toks[:N_CTX])
            for il in range(n_layer):
                xs[il].append(got[("ffn_norm", il)][SKIP:])
                imp = np.abs(got[("ffn_swiglu", il)][SKIP:][:, perms[il]]) * weights[il]   # what the op ranks by
                imps[il].append(imp.astype(np.float16))
    try:
        loss = np.zeros((n_layer, len(RATIOS)))
        n_cand = np.zeros((n_layer, len(RATIOS)), np.int64)
        row_bytes = np.zeros(n_layer, np.int64)
        for il in tqdm(range(n_layer), desc="allocating candidates", unit="layer", disable=not progress):
            x = np.concatenate(xs[il]).astype(np.float32)
            imp = np.concatenate(imps[il]).astype(np.float32)
            score = np.stack([eng.sketch_scores(il, v) for v in x])
            nb = m.layers[il].n_blocks
            n_keep = kept_blocks(nb, SPARSITY)
            n_cand[il] = [candidate_blocks(nb, SPARSITY, r) for r in RATIOS]
            loss[il] = excess_loss(imp, score, n_keep, list(n_cand[il]))
            row_bytes[il] = _gate_up_bytes(m.layers[il], m.n_embd)
    finally:
        eng.close()
    budget = int(sum(candidate_blocks(m.layers[il].n_blocks, SPARSITY, RATIO) * row_bytes[il] for il in range(n_layer)))
    at = allocate(loss, n_cand, row_bytes, budget)
    scale = [round(RATIOS[j] / RATIO, 4) for j in at]
    base = RATIOS.index(RATIO)
    before, after = float(loss[:, base].sum()), float(loss[np.arange(n_layer), at].sum())
    if progress:
        log(f"allocate: candidate ratio per layer {' '.join(f'{RATIOS[j]:g}' for j in at)}; "
            f"excess loss {before:.4f} -> {after:.4f} at the same gate/up bytes")
    return {"scale": scale, "loss_before": round(before, 6), "loss_after": round(after, 6)}


def _perms(out: Path, m):
    from . import blockfile

    for il in range(m.n_layer):
        path = m.layer_path(out, il)
        yield blockfile.read_perm(path, blockfile.read_header(path))


def _sketch_weight(out: Path, m, il: int) -> np.ndarray:
    from .sketch import read

    return np.array(read(m.resolve(out, m.sketch.files[il]))[3], np.float32)


def _gate_up_bytes(e, n_embd: int) -> int:
    """Bytes of one neuron's gate and up rows."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def row(name: str) -> int:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]]
        return n_embd // block * size

    return row(e.gate_type) + row(e.up_type)
