"""The order stage: where each neuron sits in its layer's block file (co-activation order).

Sparse decode reads the blocks a token selects. Per-neuron selection in GGUF order scatters one
token's selection over the whole file, and each scattered block costs an I/O. Following Ripple
(2024), neurons that are selected together are placed together, so that one token's selection
falls into few contiguous runs that the read planner (native/src/io.c) reads in few I/Os,
bridging the small gaps. The selection itself is unchanged: per neuron, from the layer's own
input; only the file order moves.

The profile is llama.cpp's own activations on the converter's calibration text (never the
evaluation text): for every kept position the |silu(gate) * up| of every neuron, and from them
the set a token reads at the default setting (the top ``candidate_ratio x (1 - sparsity)`` of
the layer: the candidates, whose blocks are read whole). Per layer, with M the [tokens, n_ff]
0/1 matrix of these sets and C = M^T M (how often two neurons are read together):

    coact   a greedy chain through C: start at the most often read neuron, then repeatedly the
            unplaced neuron read most often together with the last one placed (a max-weight
            Hamiltonian path heuristic: the reads of one token are the runs of its set, and a run
            continues wherever two neighbours are read together)
    freq    by how often each neuron is read, most often first (hot neurons contiguous)
    importance  by mean |h| x ||down column||, most important first: dense mode pins a prefix of
            every layer, so its resident set (speculative decoding's draft FFN) is each layer's
            most important neurons one by one, and the rest streams as one contiguous range

docs/design.md §14 and §21 have the measurements behind the default.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

METHODS = ("importance", "coact", "freq", "none")
SPARSITY, CANDIDATE_RATIO = 0.5, 1.5   # leanstream mode's defaults (tests/e2e/test_read_planning.py checks)
DEFAULT_METHOD = "importance"
N_CTX = 512            # tokens per profiled chunk (the first SKIP of each are not kept)
SKIP = 16
MAX_TOKENS = 4096      # kept positions at most


def read_sets(a: np.ndarray, n_read: int) -> np.ndarray:
    """uint8 [T, n_ff]: 1 where the neuron is among the n_read largest |a| of its row."""
    idx = np.argpartition(-np.abs(a), n_read - 1, axis=1)[:, :n_read]
    m = np.zeros(a.shape, dtype=np.uint8)
    np.put_along_axis(m, idx, 1, axis=1)
    return m


def chain_order(co: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """Greedy max-weight path through the co-occurrence matrix (see module doc)."""
    n = len(freq)
    placed = np.zeros(n, dtype=bool)
    order = np.empty(n, dtype=np.int64)
    cur = int(np.argmax(freq))
    for i in range(n):
        order[i] = cur
        placed[cur] = True
        if i == n - 1:
            break
        row = np.where(placed, -1.0, co[cur])
        cur = int(np.argmax(row))
    return order


def order_from_sets(m: np.ndarray, method: str, importance: np.ndarray | None = None) -> np.ndarray:
    """A layer's on-disk neuron order from its read sets m [T, n_ff] (importance [n_ff]: each
    neuron's mean |h| x ||down column||, for the importance order)."""
    n = m.shape[1]
    if method == "importance":
        if importance is None:
            raise ValueError("the importance order needs each neuron's importance")
        return np.argsort(-importance, kind="stable")
    if method == "none" or len(m) == 0:
        return np.arange(n, dtype=np.int64)
    freq = m.sum(axis=0, dtype=np.int64)
    if method == "freq":
        return np.argsort(-freq, kind="stable")
    if method == "coact":
        f = m.astype(np.float32)
        return chain_order(f.T @ f, freq)
    raise ValueError(f"order must be one of {', '.join(METHODS)}, got {method!r}")


def runs(m: np.ndarray, order: np.ndarray, max_gap: int = 0) -> float:
    """Mean reads per token of the sets m laid out in ``order``: runs of read neurons, counting
    gaps of at most max_gap unread neurons as bridged (the read planner's rule, one neuron per
    block)."""
    mm = m[:, order].astype(bool)
    total = 0
    for row in mm:
        pos = np.flatnonzero(row)
        if len(pos):
            total += 1 + int(np.count_nonzero(np.diff(pos) > max_gap + 1))
    return total / max(len(mm), 1)


def profile_read_sets(src, text_path, *, n_read_of, n_threads: int = 2,
                      progress: bool = True) -> tuple[list[np.ndarray], np.ndarray]:
    """Per layer, uint8 [T, n_ff] read sets of the kept positions of the calibration text(s)
    (``text_path``: one file or several); n_read_of(n_ff) is how many neurons a token reads. And
    f32 [n_layer, n_ff]: each neuron's mean |h| over those positions (GGUF order)."""
    from tqdm import tqdm

    from .profile import Profiler, text_sequences

    sets: list[list[np.ndarray]] = []
    abs_sum: list[np.ndarray] = []
    paths = [text_path] if isinstance(text_path, (str, Path)) else list(text_path)
    with Profiler(src, n_ctx=N_CTX, n_threads=n_threads) as prof:
        # the files' chunks taken in turn, so that every domain is in the first MAX_TOKENS
        per_file = [text_sequences(prof, p, n_ctx=N_CTX, skip=SKIP) for p in paths]
        seqs = [q for group in itertools.zip_longest(*per_file) for q in group if q is not None]
        kept = 0
        for seq in tqdm(seqs, desc="profiling co-activation", unit="chunk", disable=not progress):
            if kept >= MAX_TOKENS:
                break
            got = prof.run(seq["tokens"])
            start = seq["start"]
            if not sets:
                sets = [[] for _ in range(prof.n_layer)]
            take = min(len(seq["tokens"]) - start, MAX_TOKENS - kept)
            for il in range(prof.n_layer):
                a = got[("ffn_swiglu", il)][start:]
                sets[il].append(read_sets(a, n_read_of(a.shape[1])))
                s = np.abs(a[:take]).sum(axis=0, dtype=np.float64)
                if len(abs_sum) <= il:
                    abs_sum.append(s)
                else:
                    abs_sum[il] += s
            kept += take
    mean_abs = (np.stack(abs_sum) / max(kept, 1)).astype(np.float32)
    return [np.concatenate(s)[:MAX_TOKENS] for s in sets], mean_abs


def neuron_orders(src, text_path, *, method: str, n_read_of, n_threads: int = 2, down_norm=None,
                  progress: bool = True, log=print) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """One on-disk neuron order per layer (module doc), and f32 [n_layer, n_ff] in that order: how
    often each neuron was read on the calibration text (the hot set's ranking), and its mean |h|.
    down_norm(il) -> f32 [n_ff]: the ||down column|| of layer il's neurons (the importance order)."""
    from tqdm import tqdm

    sets, mean_abs = profile_read_sets(src, text_path, n_read_of=n_read_of, n_threads=n_threads, progress=progress)
    orders, freqs, before, after = [], [], 0.0, 0.0
    for il, m in enumerate(tqdm(sets, desc=f"ordering neurons ({method})", unit="layer", disable=not progress)):
        imp = mean_abs[il] * down_norm(il) if method == "importance" else None
        o = order_from_sets(m, method, imp)
        orders.append(o)
        freqs.append(m.mean(axis=0, dtype=np.float64)[o].astype(np.float32))
        if progress:   # (the log line's figures only)
            before += runs(m, np.arange(m.shape[1]))
            after += runs(m, o)
    if progress and sets:
        log(f"order: {len(sets[0])} calibration tokens; runs of read neurons per token "
            f"{before:.0f} in GGUF order, {after:.0f} in {method} order (before read bridging)")
    return orders, np.stack(freqs), np.stack([mean_abs[il][o] for il, o in enumerate(orders)])
