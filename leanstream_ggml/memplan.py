"""The memory plan: what a whole process needs besides the FFN engine, and the budget a memory
limit leaves the engine.

``Llama(model_dir, memory_limit="1000MB")`` (and ``--memory-limit`` on the command line) plans
before anything is opened. What a process holds under a whole-process limit (a memory cgroup
charges anonymous memory and the page cache of the files it reads alike):

- ``process``: the interpreter and the libraries, as this process holds them now (VmRSS);
- ``weights``: the non-FFN tensors of base.gguf that every token reads (attention, norms, the
  output matrix; of the token embedding only the rows of the context's tokens, unless it is
  also the output matrix), read from its GGUF header with ggml's own gguf reader;
- ``kv_cache``: n_ctx x the layers' K and V widths x 2 bytes (f16);
- ``compute``: llama.cpp's compute buffers and the op's scratch for a batch of n_ubatch tokens,
  as measured (docs/design.md §18): a fixed part and a part per token of the batch;
- ``tables``: the engine's per-block tables;
- ``logits``: the rows of logits one decode returns (n_seq_max: cleared at load, held whole), twice:
  the graph's result tensor and llama.cpp's output buffer;
- ``scores``: with logits_all, llama-cpp-python's array of every position's logits (n_ctx rows);
- ``captures``: what a pass of the converter writes the FFN's activations into (activations.py);
- ``margin``: what the measurements scatter by.

The engine's budget (its cache and what it keeps resident: the sketch, the predictors) is the
limit minus their sum; a limit that leaves less than the mode's least working set is refused with
the numbers. ``leanstream info MODEL --memory-limit L`` prints the plan. ``fit`` is the one loop
that gives way (a smaller batch, a pass's fewer rows, a shorter context) until a plan leaves the
engine its least cache and FIT_SPARE more: Llama's defaults (llama._fit), the converter's passes
and chat's context use it.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

MiB = 1 << 20

# measured on Qwen2.5-Coder-1.5B and SmolLM2 (bench/memory_breakdown.py, docs/design.md §18):
# anonymous memory after a chat, less what each part is known to hold. Re-measured 2026-12-06
# (dense, n_ubatch 64, in one process, Python's cyclic garbage collected): the glibc heap beyond
# the interpreter's, 66 MiB on Qwen and 23 on SmolLM2, holds the engine's tables (9 and 2 MiB of
# it), which ``tables`` counts: 57 and 21 MiB besides them, ~360 B per vocabulary entry + 5 MiB
HEAP_FIXED = 8 * MiB
HEAP_PER_VOCAB = 360           # bytes per vocabulary entry: llama.cpp's vocabulary and a token's sampling
# a prefill's growth (the compute buffer's touched pages, the op's scratch): ~22 B per (token of
# the ubatch x n_embd) on both models, 5 MiB (Qwen) and 2.5 (SmolLM2) at n_ubatch 64 (it was
# 8 MiB + 64 B, 14 MiB on Qwen at 64)
COMPUTE_FIXED = 4 * MiB
COMPUTE_PER_UBATCH_VALUE = 32  # bytes per (token of the batch x n_embd): activations of one ubatch
# the engine's tables (states, slots, checksums, plans, the read queue) after its first tokens,
# dense and leanstream alike: 10.1 MiB for Qwen's 250,880 blocks, 3.2 for SmolLM2's 46,080
TABLES_FIXED = 2 * MiB
TABLES_PER_BLOCK = 40
MARGIN = 16 * MiB
# what a fit gives way for besides the least cache: defaults that leave the engine at its very least
# (dense: one layer's blocks, every pass streaming all but a sliver) cost more than they bring
# (Qwen2.5-Coder-1.5B at 500 MB: speculation then drafts from ~0.2 % of the FFN; a chain accepted
# 6 of 102 drafted tokens there)
FIT_SPARE = 16 * MiB
MIN_CACHE = 32 * MiB           # the least cache a plan gives a sparse mode's engine (dense: one layer)


class MemoryPlanError(ValueError):
    """The limit cannot hold the process besides the engine's least working set. ``plan``: the
    MemoryPlan that refused (None when the model could not be planned at all)."""

    def __init__(self, message: str, plan: MemoryPlan | None = None):
        super().__init__(message)
        self.plan = plan


@dataclass
class BaseModelInfo:
    """What the plan needs from base.gguf's header."""
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    kv_width: int              # sum over layers of (n_embd_k_gqa + n_embd_v_gqa) per token
    tensor_bytes: dict[str, int] = field(default_factory=dict)
    n_ctx_train: int = 0       # <arch>.context_length (what n_ctx=0 means to llama.cpp)

    @property
    def per_token_weights(self) -> int:
        """Bytes of base.gguf's tensors every token reads (all but the token embedding, unless
        that is the output matrix too)."""
        tied = "output.weight" not in self.tensor_bytes
        return sum(b for n, b in self.tensor_bytes.items() if tied or n != "token_embd.weight")

    def embedding_rows(self, n_ctx: int) -> int:
        """Bytes of the token embedding's rows a context of n_ctx tokens can touch (when it is not
        counted whole), at most the whole matrix."""
        if "output.weight" not in self.tensor_bytes:
            return 0
        emb = self.tensor_bytes.get("token_embd.weight", 0)
        return min(emb, emb * n_ctx // max(self.n_vocab, 1) + 4096 * n_ctx)


def read_base(path: str | os.PathLike) -> BaseModelInfo:
    """base.gguf's architecture, sizes and tensor bytes, from its header (nothing else is read),
    by ggml's own gguf reader (the libggml-base libllama loaded)."""
    from leanstream_ggml.llamacpp import ggml_ctypes

    g = ggml_ctypes.base()
    ctx = g.gguf_init_from_file(str(path).encode(), ggml_ctypes.GGUFInitParams(True, None))
    if not ctx:
        raise MemoryPlanError(f"{path}: not a readable GGUF file")
    try:
        def key(name):
            return g.gguf_find_key(ctx, name.encode())

        def u32(name, default=None):
            k = key(name)
            if k < 0:
                return default
            t = g.gguf_get_kv_type(ctx, k)
            if t == ggml_ctypes.GGUF_TYPE_ARRAY:           # per-layer values (e.g. head_count_kv): the largest
                n = g.gguf_get_arr_n(ctx, k)
                data = g.gguf_get_arr_data(ctx, k)
                at = g.gguf_get_arr_type(ctx, k)
                ct = ctypes.c_int32 if at == ggml_ctypes.GGUF_TYPE_INT32 else ctypes.c_uint32
                return max((ct * n).from_address(data)) if n else default
            return g.gguf_get_val_u32(ctx, k)

        k = key("general.architecture")
        arch = g.gguf_get_val_str(ctx, k).decode() if k >= 0 else "llama"
        n_layer = u32(f"{arch}.block_count", 0)
        n_embd = u32(f"{arch}.embedding_length", 0)
        n_head = u32(f"{arch}.attention.head_count", 1) or 1
        n_head_kv = u32(f"{arch}.attention.head_count_kv", n_head) or n_head
        k_len = u32(f"{arch}.attention.key_length", n_embd // n_head)
        v_len = u32(f"{arch}.attention.value_length", n_embd // n_head)
        tk = key("tokenizer.ggml.tokens")
        n_vocab = g.gguf_get_arr_n(ctx, tk) if tk >= 0 else u32(f"{arch}.vocab_size", 0)
        tensors = {g.gguf_get_tensor_name(ctx, i).decode(): g.gguf_get_tensor_size(ctx, i)
                   for i in range(g.gguf_get_n_tensors(ctx))}
        n_ctx_train = u32(f"{arch}.context_length", 0)
    finally:
        g.gguf_free(ctx)
    return BaseModelInfo(arch=arch, n_layer=n_layer, n_embd=n_embd, n_vocab=n_vocab,
                         kv_width=n_layer * n_head_kv * (k_len + v_len), tensor_bytes=tensors,
                         n_ctx_train=n_ctx_train)


def proc_field(field: str, path: str = "/proc/self/status") -> int | None:
    """A ``Field:  N kB`` line of a /proc file in bytes (``/proc/self/status``: VmRSS, VmHWM;
    ``/proc/meminfo``: MemAvailable), None where the file or the field cannot be read. The one
    reader of /proc that the plan and the converter's budget (leanstream_convert/budget.py) use."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


UNLIMITED = 1 << 60    # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def cgroup_limits(proc_cgroup: str | None = None, root: Path = Path("/sys/fs/cgroup")) -> list[tuple[int, str]]:
    """(bytes, file) of every memory limit set on this process's cgroup and its ancestors, v1
    (memory.limit_in_bytes) and v2 (memory.max)."""
    try:
        text = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        ctrls, rel = parts[1], parts[2]
        if ctrls == "":
            base, fname = root, "memory.max"                      # v2 (unified)
            if (root / "unified").is_dir() and not (root / "memory.max").exists() and not (root / "cgroup.controllers").exists():
                base = root / "unified"
        elif "memory" in ctrls.split(","):
            base, fname = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        d = base / rel.lstrip("/")
        while True:
            f = d / fname
            try:
                v = f.read_text().strip()
            except OSError:
                v = ""
            if v and v != "max":
                try:
                    n = int(v)
                except ValueError:
                    n = UNLIMITED
                if n < UNLIMITED:
                    out.append((n, str(f)))
            if d == base or d.parent == d:
                break
            d = d.parent
    return out


def machine_limit() -> tuple[int, str]:
    """(bytes, where it comes from): what this process may hold, the smallest of its memory
    cgroups' limits and the memory available now (MemAvailable plus what it holds itself)."""
    cands = [(n, f"the memory cgroup's limit ({f})") for n, f in cgroup_limits()]
    avail = proc_field("MemAvailable", "/proc/meminfo")
    if avail is not None:
        cands.append((avail + (proc_field("VmRSS") or 0), "the memory available now"))
    if not cands:
        return UNLIMITED, "no limit found"
    return min(cands)


def process_bytes() -> int:
    """This process's resident memory now (VmRSS), after the C allocator has handed its free pages
    back to the kernel: heap that was freed but kept (glibc keeps tens of MB after a stage's large
    arrays, more or less from one machine to the next) is not memory the process holds."""
    _trim_heap()
    return proc_field("VmRSS") or 0


def _trim_heap() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):         # not glibc: nothing to hand back this way
        pass


def _fmt(n: int) -> str:
    return f"{n / MiB:8.1f} MiB"


@dataclass
class MemoryPlan:
    """A whole-process memory limit split into what the process needs besides the FFN engine
    (``parts``) and the engine's budget (its cache plus ``resident``: the sketch and predictors
    the mode keeps in memory)."""
    limit: int
    parts: dict[str, int]
    notes: dict[str, str]
    resident: int
    mode: str
    fitted: dict = field(default_factory=dict)   # settings left to their defaults that the limit changed
    n_ctx: int = 0
    layer_bytes: int = 0       # the largest layer's blocks: what the dense engine needs at least
    ffn_bytes: int = 0         # every layer's blocks: a cache this large streams nothing

    @property
    def min_cache(self) -> int:
        """The least cache the plan gives the engine: one layer's blocks in dense mode (the
        engine's own least working set: it streams the rest), else MIN_CACHE."""
        from leanstream_ggml.native import modes

        return self.layer_bytes if self.layer_bytes and not modes.is_sparse(self.mode) else MIN_CACHE

    @property
    def streams(self) -> bool:
        """Whether the cache holds less than the whole FFN (every pass reads the rest from disk)."""
        return self.cache < self.ffn_bytes

    @property
    def fits(self) -> bool:
        """Whether the limit leaves the engine its least cache (``check`` passes)."""
        return self.cache >= self.min_cache

    @property
    def spare(self) -> int:
        """The cache beyond the engine's least."""
        return self.cache - self.min_cache

    @property
    def reserve(self) -> int:
        return sum(self.parts.values())

    @property
    def budget(self) -> int:
        return self.limit - self.reserve

    @property
    def cache(self) -> int:
        return self.budget - self.resident

    def lines(self) -> list[str]:
        out = [f"memory plan for {self.mode} mode under a whole-process limit of {self.limit / 1e6:.0f} MB "
               f"({self.limit / MiB:.0f} MiB):"]
        if self.fitted:
            out.append("  fitted to the limit: " + ", ".join(f"{k}={v}" for k, v in self.fitted.items())
                       + " (defaults changed for this limit; give them to choose otherwise)")
        for k, v in self.parts.items():
            out.append(f"  {k:<12}{_fmt(v)}  {self.notes.get(k, '')}")
        out.append(f"  {'engine':<12}{_fmt(self.budget)}  memory_budget = limit - the above")
        if self.resident:
            out.append(f"    {'resident':<10}{_fmt(self.resident)}  sketch/predictors the mode keeps in memory")
        out.append(f"    {'cache':<10}{_fmt(self.cache)}  FFN weights kept between tokens")
        return out

    def to_dict(self) -> dict:
        """The plan as JSON: bytes of each part, the limit, the engine's budget and its resident part."""
        return {**self.parts, "limit": self.limit, "budget": self.budget, "resident": self.resident}

    def check(self) -> None:
        """Raise MemoryPlanError (with the plan) when the limit leaves the engine too little."""
        if not self.fits:
            need = self.reserve + self.resident + self.min_cache
            raise MemoryPlanError(
                f"memory_limit {self.limit / 1e6:.0f} MB cannot hold this model in {self.mode} mode: it needs at "
                f"least {need / MiB:.0f} MiB ({self.reserve / MiB:.0f} MiB besides the engine"
                + (f", {self.resident / MiB:.0f} MiB resident sketch/predictors" if self.resident else "")
                + f", {self.min_cache / MiB:.0f} MiB of cache).\n" + "\n".join(self.lines())
                + (f"\n(dense mode keeps nothing resident: it needs {(self.reserve + (self.layer_bytes or MIN_CACHE)) / 1e6:.0f} MB)"
                   if self.resident else "")
                + self._n_ctx_hint(), self)

    def _n_ctx_hint(self) -> str:
        """What a smaller context would do: the largest n_ctx (a multiple of 256, as llama.cpp pads
        it) whose KV cache leaves the least cache, if one of at least 256 does."""
        kv = self.parts.get("kv_cache")
        if not kv or self.n_ctx <= 256:
            return ""
        per_token = kv / self.n_ctx
        fit = int((self.n_ctx - (self.min_cache - self.cache) / per_token) // 256 * 256)
        if fit < 256:
            return (f"\n(n_ctx {self.n_ctx} holds {kv / MiB:.0f} MiB of KV cache; even n_ctx 256 would leave "
                    f"too little)")
        return (f"\n(n_ctx {self.n_ctx} holds {kv / MiB:.0f} MiB of KV cache: n_ctx {fit}, `-c {fit}` on the "
                f"command line, would fit, freeing {kv * (1 - fit / self.n_ctx) / MiB:.0f} MiB)")


def plan(model_dir, manifest, limit: int, *, mode: str, n_ctx: int = 512, n_ubatch: int = 512,
         resident: int | None = None, process: int | None = None, base: BaseModelInfo | None = None,
         n_outputs: int = 1, outputs_of: str | None = None, scores: int = 0, captures: int = 0) -> MemoryPlan:
    """The plan for one model directory (its manifest given) under ``limit`` bytes. ``resident``:
    bytes of the sketch/predictor files the mode loads (default: as the manifest names them);
    ``process``: bytes the process holds before the model (default: this process, now);
    ``n_outputs``: logit rows one decode returns (a speculative verify pass's rows, a pass that
    keeps every row's: its rows; ``outputs_of`` names which); ``scores``: rows of logits the caller
    keeps besides (llama-cpp-python's logits_all array: n_ctx); ``captures``: bytes of the buffers
    a converter's pass captures the FFN's activations in."""
    if base is None:
        base = read_base(manifest.resolve(model_dir, manifest.base.file))
    if resident is None:
        resident = resident_bytes(model_dir, manifest, mode)
    if n_ctx <= 0:
        n_ctx = base.n_ctx_train or 4096
    row = base.n_vocab * 4
    parts = {
        "process": process_bytes() if process is None else process,
        "weights": base.per_token_weights + base.embedding_rows(n_ctx),
        "kv_cache": n_ctx * base.kv_width * 2,
        "heap": HEAP_FIXED + HEAP_PER_VOCAB * base.n_vocab,
        "compute": COMPUTE_FIXED + COMPUTE_PER_UBATCH_VALUE * n_ubatch * base.n_embd,
        "tables": TABLES_FIXED + TABLES_PER_BLOCK * _n_blocks(manifest) if manifest is not None else 0,
        # a pass's logits are held twice: the graph's result tensor (the compute buffer) and
        # llama.cpp's output buffer it is copied to
        "logits": 2 * n_outputs * row,
        **({"scores": scores * row} if scores else {}),
        **({"captures": captures} if captures else {}),
        "margin": MARGIN,
    }
    tied = "output.weight" not in base.tensor_bytes
    if outputs_of is None and n_outputs > 1:
        outputs_of = "a speculative verify pass"
    notes = {
        "process": "the interpreter and libraries, before the model",
        "weights": "base.gguf tensors every token reads (attention, norms, "
                   + ("the embedding = output matrix)" if tied else "output matrix; embedding rows of the context)"),
        "kv_cache": f"n_ctx {n_ctx} x {base.kv_width} K/V values x 2 bytes",
        "heap": f"llama.cpp's vocabulary ({base.n_vocab} tokens) and sampling",
        "compute": f"activations of a batch of n_ubatch {n_ubatch} tokens",
        "tables": "the engine's per-block tables",
        "logits": f"{n_outputs} row{'s' if n_outputs > 1 else ''} of {base.n_vocab} logits, twice (the graph's and llama.cpp's copy)"
                  + (f" ({outputs_of})" if outputs_of else ""),
        "scores": f"{scores} rows of {base.n_vocab} logits llama-cpp-python keeps (logits_all: every position's)",
        "captures": "a pass's capture buffers: f32 [rows, n_ff] per layer (the converter's activations)",
        "margin": "measurement scatter",
    }
    layer_bytes, ffn_bytes = ffn_geometry(manifest)
    return MemoryPlan(limit=limit, parts=parts, notes=notes, resident=resident, mode=mode, n_ctx=n_ctx,
                      layer_bytes=layer_bytes, ffn_bytes=ffn_bytes)


def ffn_geometry(manifest) -> tuple[int, int]:
    """(the least the engine holds to compute a layer, every layer's FFN bytes): dense, the
    largest layer's blocks; a mixture-of-experts model, one token's routed experts of its largest
    layer (a batch routed to more streams through them: native/src/moe.c)."""
    if manifest is None:
        return 0, 0
    if manifest.moe is not None:
        moe = manifest.moe
        return (moe.n_expert_used * max(e.expert_stride for _, e in moe.expert_layers()),
                sum(moe.n_expert * e.expert_stride for _, e in moe.expert_layers()))
    layers = manifest.layers
    return (max((e.n_blocks * e.block_stride for e in layers), default=0),
            sum(e.n_blocks * e.block_stride for e in layers))


def _n_blocks(manifest) -> int:
    """The engine's table entries: blocks (dense), experts (a mixture-of-experts model)."""
    if manifest.moe is not None:
        return manifest.moe.n_expert * len(manifest.moe.expert_layers())
    return sum(e.n_blocks for e in manifest.layers)


def fit(plan_for: Callable[[dict], MemoryPlan], steps: Iterable[dict], start: dict | None = None,
        spare: int = FIT_SPARE) -> MemoryPlan:
    """The plan of the first settings along ``steps`` that leave the engine its least cache and
    ``spare`` bytes more, or where none does the last one (the most given way: its ``check``
    refuses it where it leaves less than the least). ``plan_for(settings)`` plans with
    ``settings``, {name: value} of what gives way (each caller's own: Llama's n_batch,
    draft_width and speculative; a converter pass's rows; chat's n_ctx), absent names at the
    caller's defaults; they start as ``start`` and each step's values are laid over those before
    it. The plan's ``fitted``: the settings it was made with (over what plan_for's own plan says
    it fitted)."""
    settings = dict(start or {})
    plan = plan_for(settings)
    for step in steps:
        if plan.spare >= spare:
            break
        settings = {**settings, **step}
        plan = plan_for(settings)
    plan.fitted = {**plan.fitted, **settings}
    return plan


def resident_bytes(model_dir, manifest, mode: str) -> int:
    """Bytes of the files the mode keeps in memory: its sketch and predictor files (0 in dense)."""
    from leanstream_ggml.native import modes

    if not modes.is_sparse(mode):
        return 0
    files = manifest.mode_files(model_dir, modes.uses(mode), mode)
    return sum(manifest.resolve(model_dir, f).stat().st_size for f in (files.sketches or []) + (files.predictors or []))
