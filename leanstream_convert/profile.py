"""Activation profiling with llama.cpp itself (`leanstream profile MODEL`).

For every calibration sequence, one llama_decode with outputs on every position runs the
ORIGINAL GGUF with a ggml eval callback (cb_eval) that copies, per layer il,

    ffn_inp-il      x_n   [n_tokens, n_embd]  residual entering the FFN
    ffn_norm-il     h_n   [n_tokens, n_embd]  FFN input after the norm
    ffn_swiglu-il   a_n   [n_tokens, n_ff]    silu(gate)*up, signed (|a| = neuron importance)

(names of the vendored llama.cpp's llama/qwen2 graphs, src/models/*.cpp and build_ffn; gemma3's
sa_out and ffn_geglu are taken as ffn_inp and ffn_swiglu).
Only decode-like positions are kept: the model's generated tokens (default calibration), or
every position but the first few of a chunk of text (--calibration). Position 0 is never kept:
it carries atypical huge activations (docs/design.md §9) and never occurs in decoding.

Output directory (restartable: finished chunks are skipped on a rerun):
    meta.json                  model geometry, chunk list, settings
    sequences.json             token ids and first kept position of each sequence
    chunk_NNNNN.{x,xn,a}.npy   f16 [n_layer, T, n_embd|n_ff] (one chunk = a few sequences)
Nothing large is held in RAM: each chunk is written as soon as it is complete.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import time
from functools import partial
from pathlib import Path

import numpy as np

from leanstream_ggml.texts import is_chat, read_chats, render_chat

from ._faults import kill_point
from .fileio import atomic_write_json, atomic_writer

KINDS = {"ffn_inp": "x", "ffn_norm": "xn", "ffn_swiglu": "a"}
# the same tensors under other graphs' names: gemma3 (src/models/gemma3.cpp) calls the residual
# entering the FFN sa_out and its GELU-gated product ffn_geglu (its FFN output is normed again,
# ffn_post_norm, before the residual add: a per-token scale, which leaves the ranking of neurons
# by |a| within a token unchanged)
ALIASES = {"sa_out": "ffn_inp", "ffn_geglu": "ffn_swiglu"}
_NAME = re.compile(rb"^(ffn_inp|sa_out|ffn_norm|ffn_swiglu|ffn_geglu)-(\d+)$")
GGML_TYPE_F32 = 0


class UnsupportedProfile(RuntimeError):
    """llama.cpp's graph for this architecture does not name the tensors the profile captures."""


class GgmlTensor(ctypes.Structure):
    """ctypes mirror of struct ggml_tensor (ggml.h of the vendored llama.cpp)."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
                ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t),
                ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p),
                ("padding", ctypes.c_char * 8)]


def bundled_prompts() -> list[str]:
    from .prompts import PROMPTS

    return list(PROMPTS)


class _Capture:
    """Receives tensors from cb_eval during one llama_decode."""

    def __init__(self):
        self.data: dict[tuple[str, int], np.ndarray] = {}
        self.cb = None

    def callback(self, t_ptr, ask, _user):
        t = GgmlTensor.from_address(t_ptr)
        m = _NAME.match(t.name)
        if ask:
            return bool(m)
        if m and t.type == GGML_TYPE_F32 and t.data:
            ne0, ne1 = t.ne[0], t.ne[1]
            if t.nb[0] != 4 or t.nb[1] != 4 * ne0:
                return True
            arr = np.ctypeslib.as_array((ctypes.c_float * (ne0 * ne1)).from_address(t.data))
            name = m.group(1).decode()
            self.data[(ALIASES.get(name, name), int(m.group(2)))] = arr.reshape(ne1, ne0).copy()
        return True


class Profiler:
    """Owns a llama.cpp model + context with the capture callback (CPU backend)."""

    def __init__(self, gguf_path, *, n_ctx: int = 1024, n_threads: int | None = None):
        import llama_cpp as lc

        self.lc = lc
        # llama.cpp's load/graph chatter: llama-cpp-python forwards it to this (public) logger
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(str(gguf_path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self.n_layer = lc.llama_model_n_layer(self.model)
        self.n_embd = lc.llama_model_n_embd(self.model)
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.cap = _Capture()
        self._cb = lc.ggml_backend_sched_eval_callback(self.cap.callback)
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        cp.n_ubatch = n_ctx
        nt = n_threads or min(os.cpu_count() or 1, 4)
        cp.n_threads = cp.n_threads_batch = nt
        cp.cb_eval = self._cb
        cp.cb_eval_user_data = None
        self.n_ctx = n_ctx
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = lc.llama_batch_init(n_ctx, 0, 1)

    def tokenize(self, text: str, special: bool = True, add_bos: bool = True) -> list[int]:
        lc = self.lc
        b = text.encode()
        buf = (lc.llama_token * (len(b) + 16))()
        n = lc.llama_tokenize(self.vocab, b, len(b), buf, len(buf), add_bos, special)
        if n < 0:
            buf = (lc.llama_token * (-n))()
            n = lc.llama_tokenize(self.vocab, b, len(b), buf, len(buf), add_bos, special)
        return list(buf[:n])

    def run(self, tokens: list[int]) -> dict[tuple[str, int], np.ndarray]:
        """One sequence (<= n_ctx tokens) through the model; returns the captured tensors."""
        lc = self.lc
        n = len(tokens)
        if n > self.n_ctx:
            raise ValueError(f"sequence of {n} tokens exceeds n_ctx {self.n_ctx}")
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        b = self.batch
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1          # outputs everywhere: the last layer then sees every position
        b.n_tokens = n
        self.cap.data = {}
        rc = lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc})")
        got = self.cap.data
        missing = [(k, il) for k in KINDS for il in range(self.n_layer) if (k, il) not in got]
        if missing:
            raise UnsupportedProfile(f"cb_eval did not deliver {missing[:3]}... (architecture not supported?)")
        return got

    def close(self):
        lc = self.lc
        if getattr(self, "batch", None) is not None:
            lc.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lc.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- calibration sequences ----------------------------------------------------------------

def generate_sequences(gguf_path, prompts: list[str], *, max_tokens: int, n_ctx: int, seed: int = 0,
                       n_threads: int | None = None, progress: bool = True, n_parallel: int = 16,
                       temperature: float = 0.7, top_p: float = 0.95) -> list[dict]:
    """The model's own chat answers to the prompts: [{"tokens": [...], "start": first generated pos}].

    Decodes n_parallel answers at once (one llama_decode per step for all of them): on a small
    CPU model a step costs about the same for 1 or 16 sequences, so this is ~n_parallel x faster
    than answering the prompts one by one."""
    import llama_cpp
    from tqdm import tqdm

    nt = n_threads or min(os.cpu_count() or 1, 4)
    llm = llama_cpp.Llama(str(gguf_path), n_ctx=512, n_threads=nt, verbose=False, seed=seed)
    rng = np.random.default_rng(seed)
    sample = partial(_sample, rng=rng, temperature=temperature, top_p=top_p)   # logits [n_vocab] -> token
    out = []
    try:
        prefixes = [llm.tokenize(render_chat(llm, [{"role": "user", "content": p}], add_generation_prompt=True)
                                 .encode(), add_bos=False, special=True)[: n_ctx // 2]
                    for p in prompts]
        per_seq = min(n_ctx, max(len(t) for t in prefixes) + max_tokens + 8)
        bar = tqdm(total=len(prompts) * max_tokens, desc="generating calibration text", unit="tok",
                   disable=not progress)
        for g0 in range(0, len(prompts), n_parallel):
            out += _answer_group(llm, prefixes[g0:g0 + n_parallel], per_seq=per_seq, n_threads=nt,
                                 max_tokens=max_tokens, sample=sample, bar=bar)
        bar.close()
    finally:
        llm.close()
    return out


def _answer_group(llm, prefixes: list[list[int]], *, per_seq: int, n_threads: int, max_tokens: int,
                  sample, bar) -> list[dict]:
    """Answers to a group of chat prefixes in one context (sequence si = prefixes[si]): prefill
    them all, then one llama_decode per step for every unfinished answer, until each ends (end of
    generation, max_tokens, or per_seq tokens in all). sample: logits [n_vocab] -> token. Returns
    the sequences with at least two answer tokens, in order."""
    import llama_cpp as lc

    vocab = lc.llama_model_get_vocab(llm.model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    ctx, batch = _group_context(lc, llm.model, prefixes, per_seq, n_threads)
    try:
        toks = [list(p) for p in prefixes]
        gen = [0] * len(prefixes)            # tokens sampled per sequence
        last = _prefill(batch, prefixes)     # sequence -> its batch row with logits
        active = list(range(len(prefixes)))
        while active:
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed during calibration generation")
            nxt = []
            for si in active:
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, last[si]), shape=(n_vocab,))
                t = sample(logits)
                gen[si] += 1
                bar.update(1)
                if lc.llama_vocab_is_eog(vocab, t) or gen[si] >= max_tokens or len(toks[si]) + 1 >= per_seq:
                    continue
                toks[si].append(t)
                nxt.append(si)
            # the next step: each continuing sequence's newest token
            for n, si in enumerate(nxt):
                _put(batch, n, toks[si][-1], len(toks[si]) - 1, si, True)
                last[si] = n
            batch.n_tokens = len(nxt)
            active = nxt
        bar.update(sum(max_tokens - g for g in gen))
        return [{"tokens": [int(t) for t in toks[si]], "start": len(p)}
                for si, p in enumerate(prefixes) if len(toks[si]) > len(p) + 1]
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)


def _group_context(lc, model, prefixes: list[list[int]], per_seq: int, n_threads: int):
    """A llama.cpp context for len(prefixes) sequences of up to per_seq tokens each (one unified
    KV cache), and a batch that holds all their prompts at once. Returns (ctx, batch)."""
    cp = lc.llama_context_default_params()
    cp.n_ctx = per_seq * len(prefixes)
    cp.n_seq_max = len(prefixes)
    cp.n_batch = cp.n_ubatch = max(512, sum(len(p) for p in prefixes))
    cp.n_threads = cp.n_threads_batch = n_threads
    cp.kv_unified = True
    ctx = lc.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a generation context")
    return ctx, lc.llama_batch_init(cp.n_batch, 0, 1)


def _prefill(batch, prefixes: list[list[int]]) -> dict[int, int]:
    """Every prefix into the batch (sequence id = its index), with logits at its last position.
    Returns sequence -> batch row of those logits."""
    n, last = 0, {}
    for si, p in enumerate(prefixes):
        for pos, t in enumerate(p):
            _put(batch, n, t, pos, si, pos == len(p) - 1)
            if batch.logits[n]:
                last[si] = n
            n += 1
    batch.n_tokens = n
    return last


def _put(batch, n: int, token: int, pos: int, seq: int, logits: bool) -> None:
    """Row n of a llama_batch: token at position pos of sequence seq; logits: output them."""
    batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
    batch.seq_id[n][0] = seq
    batch.logits[n] = logits


def _sample(logits: np.ndarray, rng, temperature: float, top_p: float) -> int:
    z = logits.astype(np.float64) / max(temperature, 1e-6)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    order = np.argsort(-p)
    c = np.cumsum(p[order])
    keep = order[: int(np.searchsorted(c, top_p)) + 1]
    q = p[keep] / p[keep].sum()
    return int(rng.choice(keep, p=q))


def text_sequences(prof: Profiler, path, *, n_ctx: int, skip: int = 16) -> list[dict]:
    """--calibration FILE: plain text (chunks of n_ctx tokens) or JSONL chats (one per line:
    {"messages": [...]} or a list of messages, leanstream_ggml/texts.py; rendered as "role: content" lines:
    the profiler's raw llama.cpp model has no chat template at hand)."""
    path = Path(path)
    seqs = []
    if is_chat(path):
        docs = ["\n".join(f"{m['role']}: {m['content']}" for m in msgs) for msgs in read_chats(path)]
    else:
        docs = [path.read_text(errors="replace")]
    for d in docs:
        toks = prof.tokenize(d)
        for i in range(0, len(toks), n_ctx):
            chunk = toks[i:i + n_ctx]
            if len(chunk) > skip + 1:
                seqs.append({"tokens": chunk, "start": skip})
    return seqs


# ---- the profile run ----------------------------------------------------------------------

def profile_model(gguf_path, out_dir, *, calibration=None, n_prompts: int | None = None,
                  max_tokens: int = 192, n_ctx: int = 1024, chunk_tokens: int = 2048,
                  max_total_tokens: int | None = None, seed: int = 0, n_threads: int | None = None,
                  progress: bool = True, log=print) -> dict:
    """Profile `gguf_path` into `out_dir` (see module doc). Returns meta (also meta.json)."""
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    seqs = _calibration_sequences(gguf_path, out / "sequences.json", calibration=calibration, n_prompts=n_prompts,
                                  max_tokens=max_tokens, n_ctx=n_ctx, max_total_tokens=max_total_tokens, seed=seed,
                                  n_threads=n_threads, progress=progress)
    t_gen = time.time() - t0

    meta_file = out / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else None
    groups = _chunk_groups(seqs, chunk_tokens)
    with Profiler(gguf_path, n_ctx=n_ctx, n_threads=n_threads) as prof:
        if meta is None or meta.get("groups") != groups:
            meta = {"version": 1, "gguf": str(Path(gguf_path).name), "n_layer": prof.n_layer,
                    "n_embd": prof.n_embd, "n_ff": None, "groups": groups, "chunks": [],
                    "tokens": [], "dtype": "float16"}
        done = set(meta["chunks"])
        todo = [c for c in range(len(groups)) if c not in done]
        bar = tqdm(total=sum(len(seqs[i]["tokens"]) for c in todo for i in groups[c]),
                   desc="profiling", unit="tok", disable=not progress)
        for c in todo:
            _profile_chunk(prof, [seqs[i] for i in groups[c]], out, c, meta, bar)
            _write_json(meta_file, meta)
            kill_point("profile-chunk")
        bar.close()
    meta["seconds_generate"] = round(t_gen, 1)
    meta["seconds_total"] = round(time.time() - t0, 1)   # of this (possibly resumed) run
    _write_json(meta_file, meta)
    log(f"profile: {sum(meta['tokens'])} positions x {meta['n_layer']} layers in {time.time() - t0:.0f}s -> {out}")
    return meta


def _calibration_sequences(gguf_path, seq_file: Path, *, calibration, n_prompts, max_tokens, n_ctx,
                           max_total_tokens, seed, n_threads, progress) -> list[dict]:
    """The sequences to profile, [{"tokens", "start"}]: those of seq_file when a run before made
    them, else the model's answers to the bundled prompts (or the --calibration text), cut to about
    max_total_tokens kept positions and written to seq_file."""
    if seq_file.exists():
        return json.loads(seq_file.read_text())
    if calibration is None:
        prompts = bundled_prompts()
        if n_prompts is not None:
            prompts = prompts[:n_prompts]
        seqs = generate_sequences(gguf_path, prompts, max_tokens=max_tokens, n_ctx=n_ctx, seed=seed,
                                  n_threads=n_threads, progress=progress)
    else:
        with Profiler(gguf_path, n_ctx=n_ctx, n_threads=n_threads) as prof:
            seqs = text_sequences(prof, calibration, n_ctx=n_ctx)
    if max_total_tokens is not None:
        kept, total = [], 0
        for s in seqs:
            if total >= max_total_tokens:
                break
            kept.append(s)
            total += len(s["tokens"]) - s["start"]
        seqs = kept
    _write_json(seq_file, seqs)
    return seqs


def _chunk_groups(seqs: list[dict], chunk_tokens: int) -> list[list[int]]:
    """Consecutive sequences grouped into chunks of about chunk_tokens kept positions (indices into seqs)."""
    groups, cur, n = [], [], 0
    for i, s in enumerate(seqs):
        cur.append(i)
        n += len(s["tokens"]) - max(1, s["start"])
        if n >= chunk_tokens:
            groups.append(cur)
            cur, n = [], 0
    if cur:
        groups.append(cur)
    return groups


def _profile_chunk(prof: Profiler, seqs: list[dict], out: Path, c: int, meta: dict, bar) -> None:
    """Chunk c: its sequences through the model, the kept positions of each written as
    chunk_NNNNN.{x,xn,a}.npy (f16 [n_layer, T, dim]); the chunk and its T are added to meta (the
    caller writes meta.json)."""
    parts = {k: [] for k in KINDS.values()}
    for s in seqs:
        got = prof.run(s["tokens"])
        keep = slice(max(1, s["start"]), len(s["tokens"]))
        for name, short in KINDS.items():
            parts[short].append(np.stack([got[(name, il)][keep] for il in range(prof.n_layer)]))
        bar.update(len(s["tokens"]))
    ntok = 0
    for short, arrs in parts.items():
        arr = np.concatenate(arrs, axis=1).astype(np.float16)   # [n_layer, T, dim]
        _save_npy(out / f"chunk_{c:05d}.{short}.npy", arr)
        ntok = arr.shape[1]
        if short == "a":
            meta["n_ff"] = int(arr.shape[2])
    meta["chunks"].append(c)
    meta["tokens"].append(ntok)


class ProfileData:
    """Read access to a profile directory, one layer at a time (memory-mapped chunks)."""

    def __init__(self, out_dir):
        self.dir = Path(out_dir)
        self.meta = json.loads((self.dir / "meta.json").read_text())
        self.chunks = sorted(self.meta["chunks"])
        self.n_layer, self.n_embd, self.n_ff = self.meta["n_layer"], self.meta["n_embd"], self.meta["n_ff"]
        self.n_tokens = sum(self.meta["tokens"])

    def layer(self, kind: str, il: int, dtype=np.float32) -> np.ndarray:
        """kind in {"x", "xn", "a"} -> [T, dim] for layer il over all chunks."""
        parts = [np.load(self.dir / f"chunk_{c:05d}.{kind}.npy", mmap_mode="r")[il] for c in self.chunks]
        return np.concatenate(parts).astype(dtype)


def _save_npy(path: Path, arr: np.ndarray):
    with atomic_writer(path, durable=False) as f:
        np.save(f, arr)


def _write_json(path: Path, obj):
    atomic_write_json(path, obj, indent=None, durable=False)
