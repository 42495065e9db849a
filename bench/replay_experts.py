"""Expert cache policies replayed on a MoE model's routing trace, against Belady (the optimum).

    python bench/replay_experts.py TRACE.npz [--calib CALIB.npz] [--slots 900 2200 | --cache-gb 4 8]
                                   [--shares 0.25 0.5 0.75 0.9] [--predicted PRED.npz] [--out FILE]
    python bench/replay_experts.py --synthetic [--layers 48 --tokens 512 --experts 128 --k 8]

A trace is what each layer routed each decoded token to: int32 [n_layer, T, k] under the key
"selections" of an .npz (bench/routing_probe.py --trace writes it; --synthetic makes one with
per-layer Zipf popularity and lag-1 reuse). The engine keeps experts in ONE cache of slots shared
by every layer, keyed by (layer, expert) (native/src/cache.c). A token's decode visits layers
0..L-1 in order; each layer's k selected experts must be resident while it computes (a miss reads
one expert); they are pinned then, so a layer's own experts never evict each other. The access
stream (t=0: layer 0's experts, layer 1's, ..., then t=1, ...) is replayed through caches of C
slots. Policies:

  lru         least recently used (cache.c with no hot set)
  lfu         least frequently used: access counts since the replay began, kept for evicted
              experts too; ties to the least recent
  pinned+lru  the H (layer, expert) pairs most frequent in the calibration text pinned once
              loaded (cache.c's hot set), H a share of the slots (--shares; at most C - k), the
              rest LRU; each share reported, and the best as "pinned+lru"
  learned     bench/replay_eviction.py's learned reuse distance: its least-squares regressor,
              fitted on the calibration tokens, predicts an expert's next inter-arrival time (in
              tokens) from its last two and its mean; evicts the expert predicted to be needed
              last (at the step of its layer in the predicted token). As replay_eviction.py
              has it, a prediction is made when the expert is accessed and never revised: an
              expert whose predicted return passed without it is "needed soonest" for good
  learned+revise  the same, a prediction that passed moved on by whole predicted gaps
  belady      evicts the resident expert needed furthest in the future (needs the future)

Calibration (the hot set, the regressor; the replay's warm-up): --calib's trace if given, the
scored trace after it; else the first half of the trace, the second half scored. Both are
replayed from an empty cache; only the scored tokens count.

--predicted PRED.npz ([n_layer, T, k'] experts predicted per layer, for the scored trace alone
or for calibration+scored): read-ahead on LRU: before layer n's access, the experts predicted for
it are read into the cache (not evicting the layer before's pinned experts); counted as used
(layer n selected it) or wasted, and the demand misses that remain.

Prints one JSON object: per cache size per policy the hit rate (hits / accesses), misses per
token (experts read per token) and the gap to Belady (points of hit rate); the best online policy.
"""

from __future__ import annotations

import heapq
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

import benchkit
from replay_eviction import _fit_reuse

# Qwen3-30B-A3B Q4_K_M: gate and up Q4_K (768 rows of 2048: 1152 bytes each), down Q6_K (2048 rows of 768: 630 bytes)
EXPERT_BYTES = 2 * 768 * (2048 // 256 * 144) + 2048 * (768 // 256 * 210)
NEVER = 1 << 62


# ---- the access stream ----------------------------------------------------------------------------

def expert_stream(sel: np.ndarray, n_expert: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, starts) of a trace sel [n_layer, T, k]: step s = t * n_layer + layer accesses
    ids[starts[s]:starts[s + 1]], id = layer * n_expert + expert (negative entries and repeats
    within a step dropped; the selection's order kept)."""
    sel = np.asarray(sel, np.int64)
    L, T, k = sel.shape
    E = int(n_expert if n_expert is not None else max(int(sel.max()) + 1, 1))
    arr = sel.transpose(1, 0, 2)                                   # [T, L, k]
    valid = arr >= 0
    for j in range(1, k):
        valid[..., j] &= ~(arr[..., :j] == arr[..., j:j + 1]).any(-1)
    ids = (arr + (np.arange(L) * E)[None, :, None])[valid]
    starts = np.concatenate([[0], np.cumsum(valid.sum(-1).reshape(-1))])
    return ids.astype(np.int64), starts.astype(np.int64)


def next_use(ids: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per access, the step of the same id's next access (NEVER if none)."""
    step = np.repeat(np.arange(starts.size - 1), np.diff(starts))
    order = np.lexsort((np.arange(ids.size), ids))
    nxt = np.full(ids.size, NEVER, np.int64)
    same = ids[order[1:]] == ids[order[:-1]]
    nxt[order[:-1][same]] = step[order[1:][same]]
    return nxt


def hot_set(ids: np.ndarray, starts: np.ndarray, n_steps: int, n_hot: int) -> list[int]:
    """The n_hot ids accessed most often in steps [0, n_steps) (ties: the lower id), never-accessed ones left out."""
    counts = np.bincount(ids[: starts[n_steps]], minlength=1)
    order = np.argsort(-counts, kind="stable")[: max(0, n_hot)]
    return order[counts[order] > 0].tolist()


def _steps(ids, starts):
    ids_l, st = ids.tolist(), starts.tolist()
    for s in range(len(st) - 1):
        yield s, st[s], ids_l[st[s]:st[s + 1]]


# ---- the policies: each returns the hit (True) of every access -----------------------------------

def lru(ids: np.ndarray, starts: np.ndarray, slots: int, hot=(), on_step=None) -> np.ndarray:
    """LRU over slots; ids in hot stay for good once loaded (cache.c's hot set; at most slots - k
    of them may be, so a layer's unpinned experts always find a victim outside the layer)."""
    hot = set(hot)
    cache, pinned = OrderedDict(), set()
    hit = np.zeros(ids.size, bool)
    for s, a, step in _steps(ids, starts):
        miss = []
        for i, x in enumerate(step):        # the layer's resident experts first: pinned, most recent
            if x in pinned:
                hit[a + i] = True
            elif x in cache:
                hit[a + i] = True
                cache.move_to_end(x)
            else:
                miss.append(x)
        for x in miss:                       # the victim: the least recent, never one of the layer's
            if len(cache) + len(pinned) >= slots:
                cache.popitem(last=False)
            if x in hot:
                pinned.add(x)
            else:
                cache[x] = None
        if on_step:
            on_step(s, step, set(cache) | pinned)
    return hit


def _heap_replay(ids, starts, slots, key, on_step=None, revise=None) -> np.ndarray:
    """A replay whose victim is the resident id of the smallest key(s, i, x) (computed when id x is
    accessed at step s, access i; a tuple); a layer's experts are re-keyed before its misses evict,
    so their older entries are stale and never chosen. revise(s, resident): (id, new key) pairs
    that change at the start of step s."""
    resident, cur, heap = set(), {}, []
    hit = np.zeros(ids.size, bool)
    for s, a, step in _steps(ids, starts):
        for x, k in (revise(s, resident) if revise else ()):
            cur[x] = k
            heapq.heappush(heap, (k, x))
        miss = []
        for i, x in enumerate(step):
            if x in resident:
                hit[a + i] = True
            else:
                miss.append(x)
            cur[x] = key(s, a + i, x)
        for x in miss:
            while len(resident) >= slots:
                k, y = heapq.heappop(heap)
                if y in resident and cur[y] == k and y not in step:
                    resident.discard(y)
            resident.add(x)
        for x in step:
            heapq.heappush(heap, (cur[x], x))
        if len(heap) > 4 * (len(resident) + 64):         # drop stale entries now and then
            heap = [(cur[y], y) for y in resident]
            heapq.heapify(heap)
        if on_step:
            on_step(s, step, set(resident))
    return hit


def lfu(ids: np.ndarray, starts: np.ndarray, slots: int, on_step=None) -> np.ndarray:
    """LFU: evicts the resident expert accessed least often so far (ties: the least recent)."""
    count = {}

    def key(s, i, x):
        count[x] = count.get(x, 0) + 1
        return (count[x], s)
    return _heap_replay(ids, starts, slots, key, on_step)


def belady(ids: np.ndarray, starts: np.ndarray, slots: int, on_step=None) -> np.ndarray:
    """Belady: evicts the resident expert needed furthest in the future."""
    nxt = next_use(ids, starts).tolist()
    return _heap_replay(ids, starts, slots, lambda s, i, x: (-nxt[i],), on_step)


def fit_learned(ids: np.ndarray, starts: np.ndarray, n_layer: int, n_tokens: int) -> np.ndarray:
    """bench/replay_eviction.py's reuse regressor fitted on tokens [0, n_tokens): its 4 coefficients."""
    needs = [ids[starts[t * n_layer]:starts[(t + 1) * n_layer]] for t in range(n_tokens)]
    return _fit_reuse(needs, int(ids.max()) + 1 if ids.size else 1)


def learned(ids: np.ndarray, starts: np.ndarray, slots: int, coef, n_layer: int, on_step=None,
            revise: bool = False) -> np.ndarray:
    """The learned reuse distance: evicts the expert predicted to be needed last, its next use
    predicted at step (last token + max(1, predicted gap in tokens)) * n_layer + its layer.
    revise: a prediction that passed without the access moves on by whole predicted gaps, past now."""
    c0, c1, c2, c3 = (float(c) for c in coef)
    last, g1, g2, gsum, gcnt = {}, {}, {}, {}, {}
    due, pred, span, at = [], {}, {}, {}

    def overdue(s, resident):
        out = []
        while due and due[0][0] <= s:       # due now or before: moved past now (if due now, an access re-keys it)
            p, x = heapq.heappop(due)
            if x in resident and pred[x] == p:
                p += ((s - p) // span[x] + 1) * span[x]
                pred[x] = p
                heapq.heappush(due, (p, x))
                out.append((x, (-p, at[x])))
        return out

    def key(s, i, x):
        t = s // n_layer
        if x in last:
            g = t - last[x]
            g2[x], g1[x] = g1[x], g
            gsum[x] += g
            gcnt[x] += 1
        else:
            g1[x] = g2[x] = gsum[x] = gcnt[x] = 0
        last[x] = t
        gap = max(1.0, c0 * g1[x] + c1 * g2[x] + c2 * gsum[x] / max(gcnt[x], 1) + c3)
        p = (t + gap) * n_layer + s % n_layer
        if revise:
            pred[x], span[x], at[x] = p, gap * n_layer, s
            heapq.heappush(due, (p, x))
        return (-p, s)
    return _heap_replay(ids, starts, slots, key, on_step, overdue if revise else None)


def readahead_lru(ids, starts, pred_ids, pred_starts, slots: int, warm_steps: int = 0) -> dict:
    """LRU with read-ahead: before step s, the ids predicted for it (pred_ids[pred_starts[s]:...])
    are read into the cache as most recent, never evicting step s-1's experts. Over steps
    >= warm_steps: demand hits and misses, prefetches used (accessed at step s) and wasted."""
    cache = OrderedDict()
    out = dict(hits=0, misses=0, prefetched=0, used=0)
    pids, pst = pred_ids.tolist(), pred_starts.tolist()
    prev = []
    for s, a, step in _steps(ids, starts):
        scored = s >= warm_steps
        want = set(step)
        protect = set(prev)
        for x in pids[pst[s]:pst[s + 1]]:
            if x in cache:
                cache.move_to_end(x)
                continue
            if len(cache) >= slots:
                victim = next((y for y in cache if y not in protect), None)
                if victim is None:
                    continue
                del cache[victim]
            cache[x] = None
            protect.add(x)
            if scored:
                out["prefetched"] += 1
                out["used"] += x in want
        miss = [x for x in step if x not in cache]
        for x in step:
            if x in cache:
                cache.move_to_end(x)
        for x in miss:
            if len(cache) >= slots:
                cache.popitem(last=False)
            cache[x] = None
        if scored:
            out["hits"] += len(step) - len(miss)
            out["misses"] += len(miss)
        prev = step
    out["wasted"] = out["prefetched"] - out["used"]
    return out


# ---- a synthetic trace ----------------------------------------------------------------------------

def synthetic_trace(n_layer=48, tokens=512, n_expert=128, k=8, zipf=1.0, stick=0.3, seed=0) -> np.ndarray:
    """[n_layer, tokens, k]: per layer a Zipf(zipf) popularity over the experts (in a random order);
    each token keeps each of the layer's previous experts with probability stick, the rest drawn
    by popularity without replacement."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, n_expert + 1) ** zipf
    out = np.empty((n_layer, tokens, k), np.int32)
    for il in range(n_layer):
        p = base[rng.permutation(n_expert)]
        prev = np.array([], np.int64)
        for t in range(tokens):
            keep = prev[rng.random(prev.size) < stick]
            q = p.copy()
            q[keep] = 0
            new = rng.choice(n_expert, k - keep.size, replace=False, p=q / q.sum())
            prev = np.concatenate([keep, new])
            out[il, t] = prev
    return out


def lag1_reuse(sel: np.ndarray) -> float:
    """The share of a layer's experts at token t that it selected at t-1 too."""
    if sel.shape[1] < 2:
        return 0.0
    a, b = sel[:, 1:, :, None], sel[:, :-1, None, :]
    return float((a == b).any(-1)[sel[:, 1:] >= 0].mean())


# ---- the bench ----------------------------------------------------------------------------------------

def _load(path) -> np.ndarray:
    with np.load(path) as z:
        sel = np.asarray(z["selections"])
    if sel.ndim != 3:
        raise SystemExit(f"{path}: selections is {sel.shape}, not [n_layer, T, k]")
    return sel


def evaluate(sel, calib_tokens: int, slots_list, shares=(0.25, 0.5, 0.75), n_expert=None,
             predicted=None, expert_bytes: int = EXPERT_BYTES) -> dict:
    """The replay of trace sel [n_layer, T, k] whose first calib_tokens tokens calibrate (and warm
    the cache) and the rest are scored: per cache size (slots) per policy hit_rate,
    misses_per_token and gap_to_belady (points), and the best online policy."""
    L, T, k = sel.shape
    E = int(n_expert if n_expert is not None else int(sel.max()) + 1)
    ids, starts = expert_stream(sel, E)
    warm = calib_tokens * L
    a0, n_tok = int(starts[warm]), T - calib_tokens
    n_acc = ids.size - a0
    coef = fit_learned(ids, starts, L, calib_tokens)
    rows = []
    for C in slots_list:
        C = int(C)
        if C < k:
            raise SystemExit(f"{C} slots hold less than a layer's {k} experts")
        hits = {"lru": lru(ids, starts, C), "lfu": lfu(ids, starts, C)}
        for sh in shares:
            hits[f"pinned+lru@{sh:g}"] = lru(ids, starts, C, hot=hot_set(ids, starts, warm, min(int(sh * C), C - k)))
        hits["learned"] = learned(ids, starts, C, coef, L)
        hits["learned+revise"] = learned(ids, starts, C, coef, L, revise=True)
        hits["belady"] = belady(ids, starts, C)
        n_hit = {p: int(h[a0:].sum()) for p, h in hits.items()}
        pol = {p: {"hit_rate": round(h / max(n_acc, 1), 4), "misses_per_token": round((n_acc - h) / max(n_tok, 1), 2),
                   "gap_to_belady": round(100 * (n_hit["belady"] - h) / max(n_acc, 1), 2)} for p, h in n_hit.items()}
        pinned = [p for p in pol if p.startswith("pinned+lru@")]
        best_share = max(pinned, key=lambda p: n_hit[p]) if pinned else None
        if best_share:
            pol["pinned+lru"] = {**pol[best_share], "share": float(best_share.split("@")[1])}
        online = [p for p in pol if p != "belady" and p not in pinned]
        row = {"slots": C, "expert_gb": round(C * expert_bytes / 1e9, 2), "policies": pol,
               "best_online": max(online, key=lambda p: pol[p]["hit_rate"])}
        if predicted is not None:
            pids, pst = expert_stream(predicted, E)
            r = readahead_lru(ids, starts, pids, pst, C, warm)
            row["readahead_lru"] = {"hit_rate": round(r["hits"] / max(n_acc, 1), 4),
                                    "misses_per_token": round(r["misses"] / max(n_tok, 1), 2),
                                    "reads_per_token": round((r["misses"] + r["prefetched"]) / max(n_tok, 1), 2),
                                    "prefetched_per_token": round(r["prefetched"] / max(n_tok, 1), 2),
                                    "used_per_token": round(r["used"] / max(n_tok, 1), 2),
                                    "wasted_per_token": round(r["wasted"] / max(n_tok, 1), 2)}
        rows.append(row)
    return {"n_layer": L, "n_expert": E, "k": k, "calib_tokens": calib_tokens, "scored_tokens": n_tok,
            "accesses_per_token": round(n_acc / max(n_tok, 1), 2), "lag1_reuse": round(lag1_reuse(sel[:, calib_tokens:]), 4),
            "learned_coef": [round(float(c), 4) for c in coef], "rows": rows}


def main() -> int:
    ap = benchkit.parser(__doc__)
    ap.add_argument("trace", nargs="?", help="routing trace .npz (key selections: [n_layer, T, k])")
    ap.add_argument("--calib", default=None, help="calibration trace .npz (default: the trace's first half)")
    ap.add_argument("--slots", type=int, nargs="+", default=[900, 2200],
                    help="cache sizes in expert slots (default: ~4 and ~8 GB less ~1.2 GB of non-expert weights)")
    ap.add_argument("--cache-gb", type=float, nargs="+", default=None, help="cache sizes as total GB (overrides --slots)")
    ap.add_argument("--non-expert-gb", type=float, default=1.2, help="what --cache-gb leaves out for the rest of the model")
    ap.add_argument("--expert-bytes", type=int, default=EXPERT_BYTES, help="bytes of one expert (default: Qwen3-30B-A3B Q4_K_M)")
    ap.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 0.75, 0.9], help="pinned+lru: hot shares of the slots")
    ap.add_argument("--predicted", default=None, help="predicted experts .npz (key selections) for read-ahead on LRU")
    ap.add_argument("--synthetic", action="store_true", help="replay a synthetic trace (no TRACE needed)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--stick", type=float, default=0.3, help="synthetic: chance a layer's expert stays for the next token")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.synthetic:
        sel = synthetic_trace(a.layers, a.tokens, a.experts, a.k, a.zipf, a.stick, a.seed)
        source = {"synthetic": dict(layers=a.layers, tokens=a.tokens, experts=a.experts, k=a.k, zipf=a.zipf,
                                    stick=a.stick, seed=a.seed)}
    elif a.trace:
        sel = _load(a.trace)
        source = {"trace": a.trace}
    else:
        ap.error("give a TRACE or --synthetic")
    calib_tokens = sel.shape[1] // 2
    if a.calib:
        cal = _load(a.calib)
        if cal.shape[0] != sel.shape[0]:
            raise SystemExit(f"--calib has {cal.shape[0]} layers, the trace {sel.shape[0]}")
        kk = max(cal.shape[2], sel.shape[2])
        pad = lambda x: np.pad(x, ((0, 0), (0, 0), (0, kk - x.shape[2])), constant_values=-1)   # noqa: E731
        sel, calib_tokens = np.concatenate([pad(cal), pad(sel)], 1), cal.shape[1]
        source["calib"] = a.calib
    predicted = None
    if a.predicted:
        predicted = _load(a.predicted)
        if predicted.shape[1] == sel.shape[1] - calib_tokens:     # for the scored trace alone: none ahead in calibration
            predicted = np.concatenate([np.full((sel.shape[0], calib_tokens, predicted.shape[2]), -1), predicted], 1)
        if predicted.shape[:2] != sel.shape[:2]:
            raise SystemExit(f"--predicted is {predicted.shape}, the trace {sel.shape}")
    slots = a.slots
    if a.cache_gb:
        slots = [int((g - a.non_expert_gb) * 1e9 // a.expert_bytes) for g in a.cache_gb]
    n_expert = max(int(sel.max()), int(predicted.max()) if predicted is not None else 0) + 1
    out = {**source, "expert_bytes": a.expert_bytes,
           **evaluate(sel, calib_tokens, slots, a.shares, n_expert, predicted, a.expert_bytes)}
    if a.cache_gb:
        out["cache_gb"] = a.cache_gb
    return benchkit.emit(out, a.out)


if __name__ == "__main__":
    sys.exit(main())
