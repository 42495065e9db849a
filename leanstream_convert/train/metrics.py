"""Predictor metrics (docs/design.md §5), numpy only.

For a token with true block importance imp [B] (sum of |silu(gate)*up| over the block's
neurons) and predicted priorities prio [B], at target sparsity s the runtime computes the
n_sel = ls_kept_blocks(B, s) blocks of highest priority (round half up, at least 1):

    importance ratio = sum(imp[selected]) / sum(imp)
    top-10 % recall  = |selected ∩ true top 10 % blocks| / |true top 10 % blocks|
"""

from __future__ import annotations

import numpy as np

SPARSITIES = (0.5, 0.7, 0.8, 0.9)


def n_selected(n_blocks: int, s: float) -> int:
    """The runtime's own rule (ls_kept_blocks in native/src/mode.c), through the binding."""
    from leanstream_ggml.native.engine import kept_blocks

    return kept_blocks(n_blocks, s)


def topk_mask(score: np.ndarray, k: int) -> np.ndarray:
    """score [N, B] -> bool mask [N, B] of each row's k largest entries (ties: lower index)."""
    idx = np.argpartition(-score, k - 1, axis=1)[:, :k]
    m = np.zeros(score.shape, dtype=bool)
    np.put_along_axis(m, idx, True, axis=1)
    return m


def importance_ratio(prio: np.ndarray, imp: np.ndarray, s: float) -> float:
    sel = topk_mask(prio, n_selected(prio.shape[1], s))
    tot = imp.sum(1)
    ok = tot > 0
    return float(np.mean((imp * sel).sum(1)[ok] / tot[ok]))


def top_recall(prio: np.ndarray, imp: np.ndarray, s: float, top: float = 0.1) -> float:
    b = prio.shape[1]
    sel = topk_mask(prio, n_selected(b, s))
    true = topk_mask(imp, max(1, int(round(top * b))))
    return float(np.mean((sel & true).sum(1) / true.sum(1)))


def block_importance(abs_a: np.ndarray, perm: np.ndarray | None, k: int = 1) -> np.ndarray:
    """abs_a [N, n_ff] neuron importance -> [N, n_blocks]; block b holds neurons perm[b*k:(b+1)*k]
    (-1 = padding slot). perm None: identity, k = 1."""
    if perm is None:
        return abs_a
    perm = np.asarray(perm, dtype=np.int64)
    padded = np.concatenate([abs_a, np.zeros((abs_a.shape[0], 1), abs_a.dtype)], axis=1)
    idx = np.where(perm < 0, abs_a.shape[1], perm)
    return padded[:, idx].reshape(abs_a.shape[0], -1, k).sum(-1)


def neuron_mask_of_blocks(block_mask: np.ndarray, perm: np.ndarray | None, n_ff: int, k: int = 1) -> np.ndarray:
    """bool [N, n_blocks] -> bool [N, n_ff] (neurons of the selected blocks)."""
    if perm is None:
        return block_mask
    perm = np.asarray(perm, dtype=np.int64)
    out = np.zeros((block_mask.shape[0], n_ff + 1), dtype=bool)
    slots = np.repeat(block_mask, k, axis=1)
    idx = np.where(perm < 0, n_ff, perm)
    out[:, idx] = slots
    return out[:, :n_ff]


def summarize(prio: np.ndarray, imp: np.ndarray, sparsities=SPARSITIES) -> dict:
    return {f"{s:.1f}": {"recall_top10": top_recall(prio, imp, s), "importance_ratio": importance_ratio(prio, imp, s)}
            for s in sparsities}
