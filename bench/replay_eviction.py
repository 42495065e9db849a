"""Eviction policies replayed on the engine's own per-token needs, against Belady (the lower bound).

    python bench/replay_eviction.py MODEL.lsm [--tokens 256] [--sparsity 0.5] [--cache-mb 200 265 450]
                                    [--granularity parts|blocks] [--out FILE]

Records, for every token of held-out text decoded one at a time in leanstream mode (a budget just
below the FFN, so every layer selects through the sketch), what each layer needed: the gate/up
rows of every candidate and the down columns of the kept blocks ("parts"), or the candidates'
whole blocks as block files store them today ("blocks"). Then replays those needs through caches
of C MB at token granularity (a token reads what it needs that is not cached; then the cache keeps
the policy's most valuable parts of what it held and what was read): bytes read per token. Policies, the first half of the tokens their calibration, the second half scored:

  lru        least recently used
  frequency  keeps the parts needed most often in the calibration half (a static hot set)
  reuse      the paper's learned reuse distance: a least-squares regressor, fitted on the
             calibration half, predicts each part's next inter-arrival time from its last two and
             its mean; keeps the parts predicted to be needed soonest
  belady     keeps the parts needed soonest (needs the future: the lower bound)

Prints one JSON object: per cache size and policy the MB read per decoded token and its ratio to
Belady's, and the MB a token needs; and what the disk would read for those misses with the
engine's read rule (gaps up to --bridge-bytes read through, reads cut at 256 KiB; "parts" as a
split block file would lay them out: every gate/up row of a layer, then every down column), next
to dense mode's reads at the same cache (a fixed prefix of the scan cached).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import benchkit

POLICIES = ("lru", "frequency", "reuse", "belady")


def disk_reads(ids: np.ndarray, offset: np.ndarray, size: np.ndarray, file_of: np.ndarray, bridge: float,
               max_read: float = 256 << 10) -> tuple[int, float]:
    """(reads, bytes read) of the engine's read rule (native/src/io.c) for the part ids a token
    misses, with part p at byte offset[p] of file file_of[p]: a read goes on through a gap of
    unselected bytes no longer than bridge, within one file, and is cut every max_read bytes
    (the 64-piece limit is left out: at these sizes max_read binds first)."""
    if ids.size == 0:
        return 0, 0.0
    ids = np.sort(ids)
    start, end = offset[ids], offset[ids] + size[ids]
    gap = start[1:] - end[:-1]
    cut = np.flatnonzero((gap > bridge) | (file_of[ids][1:] != file_of[ids][:-1]))
    first = np.concatenate([[0], cut + 1])
    last = np.concatenate([cut, [ids.size - 1]])
    span = end[last] - start[first]
    return int(np.ceil(span / max_read).sum()), float(span.sum())


def replay(needs: list[np.ndarray], size: np.ndarray, capacity: float, policy: str, n_calib: int,
           disk=None):
    """Bytes read per token over tokens [n_calib, T) of needs (part ids per token; size: bytes per
    part id) through a cache of capacity bytes run from token 0 (the calibration half warms it).
    A token reads the parts it needs that are not cached; after it, the cache holds the most
    valuable parts of what it held and what the token read, by the policy's value, as many as fit
    (a part may be read and not kept: with that choice Belady is the lower bound).
    disk: (offset, file_of, bridge) of the parts on disk: returns (bytes needed, bytes read,
    reads) per token instead, the reads by disk_reads."""
    n_parts, T = size.size, len(needs)
    in_cache = np.zeros(n_parts, bool)
    last = np.full(n_parts, -1, np.int64)
    nxt_of = _next_uses(needs, n_parts) if policy == "belady" else None
    next_use = np.full(n_parts, np.inf)
    gap1, gap2, gsum, gcnt = (np.zeros(n_parts) for _ in range(4))   # inter-arrival history (reuse)
    freq = np.zeros(n_parts)
    for t in range(n_calib):
        freq[needs[t]] += 1
    coef = _fit_reuse(needs[:n_calib], n_parts) if policy == "reuse" else None
    read = disk_bytes = n_reads = 0.0
    for t in range(T):
        need = needs[t]
        if t >= n_calib:
            miss = need[~in_cache[need]]
            read += float(size[miss].sum())
            if disk is not None:
                r, b = disk_reads(miss, disk[0], size, disk[1], disk[2])
                n_reads += r
                disk_bytes += b
        seen = last[need] >= 0
        g = np.where(seen, t - last[need], 0.0)
        gap2[need] = np.where(seen, gap1[need], gap2[need])
        gap1[need] = np.where(seen, g, gap1[need])
        gsum[need] += g
        gcnt[need] += seen
        last[need] = t
        if nxt_of is not None:
            next_use[need] = nxt_of[t]
        pool = in_cache.copy()
        pool[need] = True
        cand = np.flatnonzero(pool)
        if policy == "lru":
            value = last[cand].astype(float)
        elif policy == "frequency":
            value = freq[cand]
        elif policy == "belady":
            value = -next_use[cand]
        else:   # reuse: the part predicted to be needed soonest is kept first
            mean = gsum[cand] / np.maximum(gcnt[cand], 1)
            gap = coef[0] * gap1[cand] + coef[1] * gap2[cand] + coef[2] * mean + coef[3]
            value = -(last[cand] + np.maximum(1.0, gap))
        order = cand[np.argsort(-value, kind="stable")]
        keep = order[: int(np.searchsorted(np.cumsum(size[order]), capacity, side="right"))]
        in_cache[:] = False
        in_cache[keep] = True
    n = max(1, T - n_calib)
    return (read / n, disk_bytes / n, n_reads / n) if disk is not None else read / n


def _next_uses(needs: list[np.ndarray], n_parts: int) -> list[np.ndarray]:
    nxt = np.full(n_parts, np.inf)
    out = [None] * len(needs)
    for t in range(len(needs) - 1, -1, -1):
        out[t] = nxt[needs[t]].copy()
        nxt[needs[t]] = t
    return out


def _fit_reuse(needs: list[np.ndarray], n_parts: int) -> np.ndarray:
    """Least squares: next gap ~ a*last gap + b*gap before + c*mean gap + d, over the calibration tokens."""
    last = np.full(n_parts, -1, np.int64)
    gap1, gap2, gsum, gcnt = (np.zeros(n_parts) for _ in range(4))
    X, y = [], []
    for t, need in enumerate(needs):
        seen = last[need] >= 0
        g = t - last[need]
        ok = seen & (gcnt[need] >= 2)
        if ok.any():
            idx = need[ok]
            X.append(np.stack([gap1[idx], gap2[idx], gsum[idx] / gcnt[idx], np.ones(idx.size)], 1))
            y.append(g[ok].astype(float))
        gap2[need] = np.where(seen, gap1[need], gap2[need])
        gap1[need] = np.where(seen, g, gap1[need])
        gsum[need] += np.where(seen, g, 0)
        gcnt[need] += seen
        last[need] = t
    if not X:
        return np.array([1.0, 0.0, 0.0, 0.0])
    return np.linalg.lstsq(np.concatenate(X), np.concatenate(y), rcond=None)[0]


def record(model_dir: str, text: str, n_tokens: int, sparsity: float | None, candidate_ratio: float | None,
           granularity: str):
    """(needs per token, bytes per part id, offset per part id, file per part id, the selection's
    {"sparsity", "candidate_ratio"}) from a leanstream decode (None: the engine's default)."""
    import gguf

    from leanstream_ggml import Llama
    from leanstream_ggml.model import manifest

    m = manifest.load(model_dir)
    ffn = sum(e.n_blocks * e.block_stride for e in m.layers)
    resident = (m.sketch.bytes if m.sketch else 0)
    llm = Llama(model_dir, mode="leanstream", sparsity=sparsity, candidate_ratio=candidate_ratio,
                memory_budget=int(0.95 * ffn) + resident, hot_fraction=0.0, n_ctx=max(512, n_tokens + 8), n_threads=2,
                verbose=False)
    try:
        e = llm.engine
        infos = [e.layer_info(il) for il in range(e.n_layers)]
        offs, sizes, where, files = [], [], [], []
        off = 0
        for il, info in enumerate(infos):
            k, n_embd, nb = info["neurons_per_block"], info["n_embd"], info["n_blocks"]

            def row(t):
                bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)]
                return n_embd // bs * ts
            gu = k * (row(info["gate_type"]) + row(info["up_type"]))
            dn = k * row(info["down_type"])
            offs.append(off)
            if granularity == "blocks":
                sizes.append(np.full(nb, info["block_stride"], float))
                off += nb
            else:   # part ids: [gate/up of blocks 0..nb) then [down of blocks 0..nb)
                sizes.append(np.concatenate([np.full(nb, gu, float), np.full(nb, dn, float)]))
                off += 2 * nb
            # on disk: blocks in file order; parts as a split file would hold them (the gate/up
            # rows of every block, then the down columns)
            where.append(np.concatenate([[0.0], np.cumsum(sizes[-1])[:-1]]))
            files.append(np.full(sizes[-1].size, il))
        size, offset, file_of = np.concatenate(sizes), np.concatenate(where), np.concatenate(files)
        toks = llm.tokenize(text.encode())[: n_tokens + 1]
        llm.reset()
        llm.eval(toks[:1])
        needs = []
        for t in toks[1:]:
            llm.eval([t])
            per = []
            for il, info in enumerate(infos):
                per.append(offs[il] + e.last_candidates(il))
                if granularity == "parts":
                    per.append(offs[il] + info["n_blocks"] + e.last_plan(il))
            needs.append(np.unique(np.concatenate(per)).astype(np.int64))
        selection = {"sparsity": round(llm.sparsity, 6), "candidate_ratio": round(e.candidate_ratio, 6)}
    finally:
        llm.close()
    return needs, size, offset, file_of, selection


def main() -> int:
    ap = benchkit.parser(__doc__)
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=256)
    # the bridge: the engine measures c*B at start (22-30 KiB on the disk the project measured on)
    benchkit.flags(ap, "sparsity", "candidate_ratio", "bridge_bytes", defaults={"bridge_bytes": 24 << 10})
    ap.add_argument("--cache-mb", type=float, nargs="+", default=[200, 265, 450])
    ap.add_argument("--granularity", choices=("parts", "blocks"), default="parts")
    ap.add_argument("--text", default=None, help="held-out text (default: the bench's bundled text)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from leanstream_tools.bench import DEFAULT_TEXT

    text = Path(a.text or DEFAULT_TEXT).read_text(encoding="utf-8")
    needs, size, offset, file_of, selection = record(a.model_dir, text, a.tokens, a.sparsity, a.candidate_ratio,
                                                     a.granularity)
    n_calib = len(needs) // 2
    need_mb = float(np.mean([size[n].sum() for n in needs[n_calib:]])) / 1e6
    disk = (offset, file_of, float(a.bridge_bytes))
    everything = np.arange(size.size)
    rows = []
    for c in a.cache_mb:
        got = {p: replay(needs, size, c * 1e6, p, n_calib, disk=disk) for p in POLICIES}
        # dense mode: every part, a fixed prefix of the scan cached (what the engine pins)
        prefix = everything[np.cumsum(size) > c * 1e6]
        d_reads, d_bytes = disk_reads(prefix, offset, size, file_of, float(a.bridge_bytes))
        rows.append({"cache_mb": c, **{f"{p}_mb_per_token": round(v[0] / 1e6, 2) for p, v in got.items()},
                     **{f"{p}_vs_belady": round(v[0] / got["belady"][0], 3) if got["belady"][0] else None
                        for p, v in got.items() if p != "belady"},
                     # what the disk reads for those misses (bridged gaps included) and in how many reads
                     **{f"{p}_disk_mb_per_token": round(v[1] / 1e6, 1) for p, v in got.items()},
                     **{f"{p}_reads_per_token": int(v[2]) for p, v in got.items()},
                     "dense_disk_mb_per_token": round(d_bytes / 1e6, 1), "dense_reads_per_token": d_reads})
    out = {"model": a.model_dir, "tokens": len(needs), "scored_tokens": len(needs) - n_calib, **selection,
           "granularity": a.granularity, "needed_mb_per_token": round(need_mb, 2), "rows": rows}
    return benchkit.emit(out, a.out)


if __name__ == "__main__":
    sys.exit(main())
