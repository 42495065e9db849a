"""The order stage: where each neuron sits in its layer's block file (co-activation order).

Sparse decode reads the blocks a token selects. Per-neuron selection in GGUF order scatters one
token's selection over the whole file, and each scattered block costs an I/O. Following Ripple
(2024), neurons that are selected together are placed together, so that one token's selection
falls into few contiguous runs that the read planner (native/src/io.c) reads in few I/Os,
bridging the small gaps. The selection itself is unchanged: per neuron, from the layer's own
input; only the file order moves.

The statistics are the activations stage's (leanstream_convert/activations.py: the plugin's dense engine,
which reproduces llama.cpp, on the converter's calibration text, never the evaluation text):
for every kept position the |silu(gate) * up| of every neuron, and from them the set a token
reads at the default setting (the top ``candidate_ratio x (1 - sparsity)`` of
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

from pathlib import Path

import numpy as np

METHODS = ("importance", "coact", "freq", "none")
SPARSITY, CANDIDATE_RATIO = 0.5, 1.5   # leanstream mode's defaults (tests/e2e/test_read_planning.py checks)
DEFAULT_METHOD = "importance"


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


def order_layer(method: str, importance: np.ndarray, reads: np.ndarray, sets: np.ndarray | None = None) -> np.ndarray:
    """One layer's on-disk neuron order from the activations stage's statistics (module doc):
    importance [n_ff] (mean |h| x ||down column||), reads [n_ff] (how often each neuron was in a
    token's read set), sets [T, n_ff] (the read sets themselves; the coact order only)."""
    n = len(importance)
    if method == "importance":
        return np.argsort(-importance, kind="stable")
    if method == "freq":
        return np.argsort(-np.asarray(reads), kind="stable")
    if method == "none":
        return np.arange(n, dtype=np.int64)
    if method == "coact":
        if sets is None:
            raise ValueError("the coact order needs the read sets")
        return order_from_sets(sets, "coact")
    raise ValueError(f"order must be one of {', '.join(METHODS)}, got {method!r}")



def neuron_orders(model, method: str, acts, sets_dir, path, *, progress: bool = True, log=print) -> None:
    """The order stage: each layer's neuron order by ``method`` from the activations stage's
    statistics (``acts``: activations.PassResult; with "coact", its read sets in ``sets_dir``),
    written to ``path`` (npz, under a temporary name and renamed) with, per layer in that order,
    f32 [n_layer, n_ff] read frequency (``freq``), mean |h| (``absh``) and ||down column||
    (``down_norm``); one layer's down columns in RAM at a time."""
    from tqdm import tqdm

    from .convert_gguf import ConvertError
    from .sketch import down_column_norms

    if acts.abs_h is None:
        raise ConvertError("the activations stage kept no neuron statistics; re-run with --force")
    n = max(acts.n_tokens, 1)
    orders, freq, absh, norms = [], [], [], []
    before = after = 0.0
    for il in tqdm(range(model.n_layer), desc=f"ordering neurons ({method})", unit="layer", disable=not progress):
        norm = down_column_norms(model.layers[il], model.n_embd)          # f32 [n_ff], GGUF order
        model.release_pages()
        mean_abs = (acts.abs_h[il] / n).astype(np.float32)
        sets = None
        if method == "coact":
            bits = np.fromfile(Path(sets_dir) / f"l{il}.bits", np.uint8).reshape(acts.n_tokens, -1)
            sets = np.unpackbits(bits, axis=1, count=model.n_ff)       # uint8 [T, n_ff], one layer's
        o = order_layer(method, mean_abs * norm, acts.reads[il], sets)
        if sets is not None and progress:
            before += runs(sets, np.arange(model.n_ff))
            after += runs(sets, o)
        orders.append(o)
        freq.append((acts.reads[il] / n).astype(np.float32)[o])
        absh.append(mean_abs[o])
        norms.append(norm[o])
    if method == "coact" and progress:
        log(f"order: runs of read neurons per token {before:.0f} in GGUF order, {after:.0f} in coact order "
            f"(before read bridging)")
    tmp = Path(path).with_suffix(".partial.npz")
    np.savez(tmp, freq=np.stack(freq), absh=np.stack(absh), down_norm=np.stack(norms),
             **{f"l{il}": o for il, o in enumerate(orders)})
    tmp.replace(path)
