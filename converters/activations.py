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
  log-likelihood of the next token and its top-1 token (converters/calibrate.py).

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
ROWS = 128         # tokens per decode: the capture buffers' rows and the logits a decode returns
MIN_ROWS = 8       # the fewest tokens per decode a tight limit falls back to


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
    kept positions at most."""
    from tqdm import tqdm

    from leanstream_ggml import Llama

    from .order import read_sets

    n_layer = manifest.n_layer
    n_slots = manifest.layers[0].n_blocks * manifest.block.k
    n_vocab = _n_vocab(model_dir, manifest)
    rows = decode_rows(model_dir, manifest, memory_limit, bool(n_read), n_vocab)
    # the capture buffers first, written once (resident): the memory plan counts what the process
    # holds when it plans; the rows of logits a decode returns are not in the plan's parts
    caps = [np.empty((rows, n_slots), np.float32) for _ in range(n_layer)] if n_read else []
    for c in caps:
        c.fill(0.0)
    if memory_limit:
        memory_limit -= (rows - 1) * n_vocab * 4
    llm = Llama(str(model_dir), _manifest=manifest, mode="dense", speculative="off", n_ctx=N_CTX, n_batch=rows,
                n_ubatch=rows, n_threads=n_threads, n_threads_batch=n_threads, verbose=False,
                **({"memory_limit": memory_limit} if memory_limit else {}))
    res = PassResult(rows=rows)
    try:
        eng = llm.engine
        for il, c in enumerate(caps):
            eng.set_capture(il, c)
        res.vocab = np.zeros(n_vocab, np.float64)
        if n_read:
            res.abs_h = np.zeros((n_layer, n_slots), np.float64)
            res.reads = np.zeros((n_layer, n_slots), np.int64)
        sets = [open(sets_dir / f"l{il}.bits", "wb") for il in range(n_layer)] if (sets_dir and n_read) else []
        try:
            seqs = _sequences(llm, texts)
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
                    for r in range(lo, hi):
                        z = llm.logits(r)
                        p = np.exp(z - z.max())
                        res.vocab += p / p.sum(dtype=np.float64)
                    for il in range(n_layer) if n_read else ():
                        if eng.capture_rows(il) != len(piece):
                            raise RuntimeError(f"layer {il}: the engine captured {eng.capture_rows(il)} rows of "
                                               f"{len(piece)} (was the dense path taken?)")
                        a = np.abs(caps[il][lo:hi])
                        res.abs_h[il] += a.sum(axis=0, dtype=np.float64)
                        m = read_sets(a, n_read)             # uint8 [rows, n_slots]
                        res.reads[il] += m.sum(axis=0, dtype=np.int64)
                        if sets:
                            sets[il].write(np.packbits(m, axis=1).tobytes())
                    res.n_tokens += hi - lo
                    bar.update(hi - lo)
                    if res.n_tokens >= max_tokens:
                        break
            bar.close()
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


def _n_vocab(model_dir: Path, manifest) -> int:
    from leanstream_ggml.memplan import read_base

    return read_base(manifest.resolve(model_dir, manifest.base.file)).n_vocab


def decode_rows(model_dir: Path, manifest, memory_limit: int | None, capture: bool, n_vocab: int) -> int:
    """Tokens per decode: ROWS, or fewer (halved down to MIN_ROWS) where the limit cannot hold ROWS rows of
    captures and logits beside the model while the engine keeps one layer's blocks (dense mode's
    least working set) and the plan's least cache."""
    from leanstream_ggml import memplan

    if not memory_limit:
        return ROWS
    n_slots = manifest.layers[0].n_blocks * manifest.block.k
    layer = max(e.n_blocks * e.block_stride for e in manifest.layers)
    base = memplan.read_base(manifest.resolve(model_dir, manifest.base.file))
    now = memplan.process_bytes()
    rows = ROWS
    while rows >= MIN_ROWS:
        captures = manifest.n_layer * rows * n_slots * 4 if capture else 0
        logits = (rows - 1) * n_vocab * 4
        plan = memplan.plan(model_dir, manifest, memory_limit - logits, mode="dense", n_ctx=N_CTX, n_ubatch=rows,
                            process=now + captures, base=base)     # as run_pass plans it
        if plan.cache >= max(memplan.MIN_CACHE, layer):
            return rows
        rows //= 2
    return MIN_ROWS


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
