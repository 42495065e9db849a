"""The profile stage: one pass of the model over the calibration corpus, run by the plugin's own
dense engine on the block files the write stage just wrote (source order), under the
conversion's memory limit. It gathers what every later stage needs (docs/design.md §22):

- per layer and neuron, over the kept positions: the sum of |h| (h = act(gate x) * up x; the
  importance order and dense mode's resident set) and how often the neuron is in a token's read
  set (the top ``n_read`` by |h|: the hot-set ranking and the freq order); for the coact order the
  read sets themselves, as packed bits on disk (one layer's at a time in RAM when ordering);
- the draft vocabulary's ranking: each token's predicted probability summed over the positions.
  A draft step of speculative decoding computes only the first rows of this ranking in its
  output projection (FR-Spec, 2025: Qwen2.5's 152k-row output matrix is more than the rest of a
  step reads; the full projection still verifies every token, so no answer changes). The mean
  predicted probability is a smooth estimate of what the model says in these domains, even of
  tokens the corpus never contains;
- with calibration, the reference of every calibration window: each scored position's negative
  log-likelihood of the next token and its top-1 token (leanstream_convert/calibrate.py).

Dense mode is the exact reference (it reproduces stock llama.cpp within llama.cpp's own rounding
noise), so the statistics are llama.cpp's. The engine writes each layer's h into a capture buffer
(``FFNEngine.set_capture``, f32 [ROWS, n_ff] per layer) for the ROWS tokens of a decode; logits
are read one row at a time from llama.cpp's output buffer. Nothing larger than one decode's
activations and logits is ever held.

Sequences: the corpus files' chunks of N_CTX tokens taken in turn (so every domain is in the first
positions), the first SKIP positions of a chunk (little context) not kept, until MAX_TOKENS
positions are kept (``convert(profile_tokens=...)``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

N_CTX = 512        # tokens per chunk
SKIP = 16          # positions of a chunk not kept
MAX_TOKENS = 4096  # kept positions at most
# The pass is compute-bound (a 7B inside 3 GB: 4224 tokens in 311 s, 74 ms a token on 2 cores,
# reading 286 MB/s), so by default a larger model runs on fewer positions: MAX_TOKENS up to
# FULL_PASS_FFN_PARAMS FFN weights (Qwen2.5-1.5B's 1.16e9 and everything smaller: unchanged), fewer
# in proportion above, never fewer than one chunk of each bundled domain (3 x (N_CTX - SKIP) = 1488)
FULL_PASS_FFN_PARAMS = 1.2e9
ROWS = 128         # tokens per decode: the capture buffers' rows and the logits a decode returns
MIN_ROWS = 8       # the fewest tokens per decode a tight limit falls back to


def default_tokens(n_layer: int, n_embd: int, n_ff: int, n_domains: int = 3) -> int:
    """The kept positions a conversion runs by default on a dense model of this shape."""
    ffn_params = 3.0 * n_layer * n_embd * n_ff
    least = n_domains * (N_CTX - SKIP)
    return max(least, min(MAX_TOKENS, int(MAX_TOKENS * FULL_PASS_FFN_PARAMS / ffn_params)))


@dataclass
class PassResult:
    n_tokens: int = 0                                   # kept positions
    rows: int = ROWS                                    # tokens per decode (decode_rows)
    abs_h: np.ndarray | None = None                     # f64 [n_layer, n_slots]: sum of |h|
    reads: np.ndarray | None = None                     # i64 [n_layer, n_slots]: times in a read set
    vocab: np.ndarray | None = None                     # f64 [n_vocab]: sum of predicted probabilities
    references: dict = field(default_factory=dict)      # calibration window refs: {domain: [(window, nll, top)]}

    def save(self, path: Path) -> None:
        from .fileio import atomic_writer

        refs = {f"ref/{d}/{i}/{part}": np.asarray(x) for d, ws in self.references.items()
                for i, wr in enumerate(ws) for part, x in zip(("window", "nll", "top"), wr)}
        arrays = {"n_tokens": np.asarray(self.n_tokens), "rows": np.asarray(self.rows), "vocab": self.vocab, **refs,
                  **({"abs_h": self.abs_h, "reads": self.reads} if self.abs_h is not None else {})}
        with atomic_writer(path, durable=False) as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: Path) -> PassResult:
        with np.load(path) as z:
            r = cls(int(z["n_tokens"]), int(z["rows"]), z["abs_h"] if "abs_h" in z else None,
                    z["reads"] if "reads" in z else None, z["vocab"])
            refs: dict = {}
            for key in z.files:
                if key.startswith("ref/") and key.endswith("/window"):
                    _, d, i, _ = key.split("/")
                    refs.setdefault(d, {})[int(i)] = tuple(z[f"ref/{d}/{i}/{p}"] for p in ("window", "nll", "top"))
            r.references = {d: [ws[i] for i in sorted(ws)] for d, ws in refs.items()}
        return r


class _Tokens:
    """profile.text_sequences' tokenizer interface over a Llama."""

    def __init__(self, llm):
        self.llm = llm

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=True, special=False)


def _sequences(llm, texts: list[Path]) -> list[dict]:
    from .profile import text_sequences

    per_file = [text_sequences(_Tokens(llm), p, n_ctx=N_CTX, skip=SKIP) for p in texts]
    return [q for group in itertools.zip_longest(*per_file) for q in group if q is not None]


def run_pass(model_dir: Path, manifest, texts: list[Path], *, memory_limit: int | None, n_threads: int,
             n_read: int | None, sets_dir: Path | None = None, calibration_windows: dict | None = None,
             max_tokens: int = MAX_TOKENS, progress: bool = True) -> PassResult:
    """The pass (module doc). n_read: neurons per read set (None: no neuron statistics, only the
    vocabulary and references); sets_dir: also write each layer's read sets there (coact order)
    as ``l<il>.bits`` (np.packbits rows of n_slots bits); calibration_windows: {domain: path} of
    the calibration texts whose windows get references (calibrate.window_tokens); max_tokens:
    kept positions at most. Under memory_limit the dense engine's plan counts the pass's capture
    buffers and its rows of logits (``pass_keywords``)."""
    from leanstream_ggml import Llama

    rows = decode_rows(model_dir, manifest, memory_limit, bool(n_read))
    llm = Llama.converting(str(model_dir), n_threads=n_threads, n_threads_batch=n_threads, verbose=False,
                           **pass_keywords(manifest, rows, bool(n_read)),
                           **({"memory_limit": memory_limit} if memory_limit else {}))
    res = PassResult(rows=rows)
    caps = []
    try:
        caps = _capture_buffers(llm, manifest, rows) if n_read else []
        res.vocab = np.zeros(_n_vocab(model_dir, manifest), np.float64)
        if n_read:
            res.abs_h = np.zeros((manifest.n_layer, caps[0].shape[1]), np.float64)
            res.reads = np.zeros((manifest.n_layer, caps[0].shape[1]), np.int64)
        sets = [open(sets_dir / f"l{il}.bits", "wb") for il in range(manifest.n_layer)] if (sets_dir and n_read) else []
        try:
            _profile(llm, _sequences(llm, texts), caps, res, n_read, sets, max_tokens, progress)
        finally:
            for f in sets:
                f.close()
        if calibration_windows:
            res.references = _references(llm, calibration_windows, rows)
    finally:
        if llm.engine is not None:
            for il in range(len(caps)):
                llm.engine.set_capture(il, None)
        llm.close()
    return res


def _capture_buffers(llm, manifest, rows: int) -> list[np.ndarray]:
    """The engine's capture buffers, f32 [rows, n_slots] per layer, written once (resident: the
    plan's ``captures`` part) and set on the engine."""
    n_slots = manifest.layers[0].n_blocks * manifest.block.k
    caps = [np.empty((rows, n_slots), np.float32) for _ in range(manifest.n_layer)]
    for il, c in enumerate(caps):
        c.fill(0.0)
        llm.engine.set_capture(il, c)
    return caps


def _profile(llm, seqs: list[dict], caps: list[np.ndarray], res: PassResult, n_read: int | None, sets: list,
             max_tokens: int, progress: bool) -> None:
    """The sequences decoded res.rows tokens at a time (every row's logits kept) until max_tokens
    positions are kept; the kept rows go into res (``_keep_rows``)."""
    from tqdm import tqdm

    rows = res.rows
    total = sum(min(len(s["tokens"]) - s["start"], max_tokens) for s in seqs)
    bar = tqdm(total=min(total, max_tokens), desc="profiling (dense, one pass)", unit="tok", disable=not progress)
    for seq in seqs:
        if res.n_tokens >= max_tokens:
            break
        toks, start = seq["tokens"], seq["start"]
        llm.reset()
        for p0 in range(0, len(toks), rows):
            piece = toks[p0:p0 + rows]
            llm.eval_all_rows(piece)
            lo = max(start - p0, 0)                                   # first kept row of the piece
            hi = min(len(piece), lo + max_tokens - res.n_tokens) if lo < len(piece) else lo
            if hi <= lo:
                continue
            _keep_rows(llm, caps, res, n_read, sets, len(piece), lo, hi)
            res.n_tokens += hi - lo
            bar.update(hi - lo)
            if res.n_tokens >= max_tokens:
                break
    bar.close()


def _keep_rows(llm, caps: list[np.ndarray], res: PassResult, n_read: int | None, sets: list, n_rows: int,
               lo: int, hi: int) -> None:
    """Rows lo..hi of the last decode (of n_rows): each one's softmax summed into res.vocab; with
    captures, each layer's |h| into res.abs_h and its read sets into res.reads (and ``sets``)."""
    from .order import read_sets

    for r in range(lo, hi):
        z = llm.logits(r)
        p = np.exp(z - z.max())
        res.vocab += p / p.sum(dtype=np.float64)
    eng = llm.engine
    for il, c in enumerate(caps):
        if eng.capture_rows(il) != n_rows:
            raise RuntimeError(f"layer {il}: the engine captured {eng.capture_rows(il)} rows of "
                               f"{n_rows} (was the dense path taken?)")
        a = np.abs(c[lo:hi])
        res.abs_h[il] += a.sum(axis=0, dtype=np.float64)
        m = read_sets(a, n_read)             # uint8 [rows, n_slots]
        res.reads[il] += m.sum(axis=0, dtype=np.int64)
        if sets:
            sets[il].write(np.packbits(m, axis=1).tobytes())


def _n_vocab(model_dir: Path, manifest) -> int:
    from leanstream_ggml.memplan import read_base

    return read_base(manifest.resolve(model_dir, manifest.base.file)).n_vocab


def capture_bytes(manifest, rows: int) -> int:
    """Bytes of the pass's capture buffers: f32 [rows, n_slots] per layer."""
    return manifest.n_layer * rows * manifest.layers[0].n_blocks * manifest.block.k * 4


def pass_keywords(manifest, rows: int, capture: bool, min_rows: int | None = None) -> dict:
    """The keywords of the pass's Llama.converting (and of its memory plan, llama.memory_plan): dense
    mode, no speculation, ``rows`` tokens per decode with every row's logits kept, and the capture
    buffers (``memory_pass``: memplan.plan's ``logits`` and ``captures`` parts); ``min_rows``: the
    plan may halve the rows down to it (its fit, ``fitted["rows"]``)."""
    pass_ = {"rows": rows, "min_rows": min_rows or rows,
             "captures_per_row": capture_bytes(manifest, 1) if capture else 0}
    return dict(manifest=manifest, memory_pass=pass_, mode="dense", speculative="off", n_ctx=N_CTX,
                n_batch=rows, n_ubatch=rows)


def pass_plan(model_dir: Path, manifest, memory_limit: int, rows: int, capture: bool):
    """The memory plan the pass's Llama makes at ``rows`` tokens per decode (llama.memory_plan: the
    same function, the same keywords)."""
    from leanstream_ggml.llama import memory_plan

    return memory_plan(model_dir, memory_limit, **pass_keywords(manifest, rows, capture))


def decode_rows(model_dir: Path, manifest, memory_limit: int | None, capture: bool) -> int:
    """Tokens per decode: ROWS, or fewer (halved down to MIN_ROWS) where the limit cannot hold ROWS
    rows of captures and logits beside the model while the engine keeps its least cache (dense
    mode: one layer's blocks) and memplan.FIT_SPARE more: the pass's Llama's own plan, which gives
    way on its rows (llama.memory_plan)."""
    from leanstream_ggml.llama import memory_plan

    if not memory_limit:
        return ROWS
    plan = memory_plan(model_dir, memory_limit, **pass_keywords(manifest, ROWS, capture, MIN_ROWS))
    return plan.fitted.get("rows", ROWS)


def _references(llm, paths: dict, rows: int) -> dict:
    """{domain: [(window, nll, top)]}: the calibration windows' references (calibrate.py), each
    window prefilled `rows` tokens at a time, each scored row's log-softmax taken alone."""
    from .calibrate import N_CTX as W, row_targets, window_tokens

    out = {}
    for name, path in paths.items():
        ws = window_tokens(llm, path)
        refs = []
        for w in ws:
            llm.reset()
            nll, top = [], []
            for p0 in range(0, len(w), rows):
                piece = w[p0:p0 + rows]
                llm.eval_all_rows(piece)
                scored = [r for r in range(len(piece)) if W // 2 <= p0 + r < W - 1]
                n, t = row_targets((llm.logits(r) for r in scored), [w[p0 + r + 1] for r in scored])
                nll.append(n)
                top.append(t)
            refs.append((np.asarray(w, np.int32), np.concatenate(nll), np.concatenate(top)))
        out[name] = refs
    return out
