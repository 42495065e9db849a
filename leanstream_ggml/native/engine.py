"""FFNEngine: the Python owner of one native ``ls_engine`` (a model directory's block files,
its weight cache and I/O workers)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from leanstream_ggml.native._native import MODES, LeanstreamError, check, ffi, lib, mode_id

ACTIVATIONS = {"silu": lib.LS_ACT_SILU, "gelu": lib.LS_ACT_GELU}
# batches of up to this many rows compute each row as that token alone (the FFN op and, through
# llama_set_exact_rows, llama.cpp's other ops): what a verify pass may hold
EXACT_ROWS = int(lib.LS_EXACT_ROWS)
DRAFT_TOP = int(lib.LS_DRAFT_TOP)   # best tokens per row the draft's output head keeps (draft_top)


def budget_bytes(value: int | None) -> int:
    """An engine's memory_budget: bytes, an int >= 0 (None, 0: no limit). Sizes like "512MiB" are
    parsed once, at the edge (params.size_bytes, through Llama's or engine_params' options), and
    arrive here as bytes."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"memory_budget: expected bytes (an int >= 0), got {value!r}; a size such as '512MiB' "
                        f"is parsed by Llama(memory_budget=...) or params.engine_params")
    return value


# The header declares the engine's parameters and counters once (ls_engine_params, ls_stats);
# these lists are read from it.
_PARAMS = [name for name, _ in ffi.typeof("ls_engine_params").fields]
# set by FFNEngine's own arguments (paths, enums, the budget); the rest are plain numbers, passed
# by name and left at the engine's default (ls_engine_params_init) when None
_OWN_PARAMS = {"n_layers", "block_paths", "activation", "mode", "memory_budget", "predictor_paths",
               "block_rank", "verify_checksums", "sketch_paths", "test_hooks"}
TUNABLE_PARAMS = tuple(name for name in _PARAMS if name not in _OWN_PARAMS)
STAT_FIELDS = [name for name, _ in ffi.typeof("ls_stats").fields]


def per(raw: dict, num: str, den: str, empty: float | None = 0.0) -> float | None:
    """raw[num] / raw[den] of a counter dict; ``empty`` where raw[den] is 0 (nothing counted yet).
    derived_stats and moe.derived_counters write their ratios with it."""
    return raw[num] / raw[den] if raw[den] else empty


# The counters every engine's stats() reports under these names, whatever its blocks are (a dense
# layer's neuron blocks, a MoE layer's experts: both are blocks read whole into one cache), and
# the metrics derived from them (common_derived): what a command or a tool that does not know the
# model's kind reads. Each engine adds its own (OWN_STATS: FFNEngine's sketch, predictors,
# prefetch, read planning, controller and draft; MoEEngine's router counters).
COMMON_COUNTERS = ("op_calls", "tokens", "blocks_computed", "blocks_read", "bytes_read", "reads_issued",
                   "io_stall_ns", "op_ns", "checksum_ns", "cache_bytes", "cache_capacity", "hot_blocks",
                   "resident_bytes", "direct_io")


def common_derived(raw: dict) -> dict:
    """The docs/design.md §5 metrics of the common counters, defined once (every engine's stats())."""
    return {"miss_ratio": per(raw, "blocks_read", "blocks_computed"),
            # totals: tokens counts each token once (not once per layer), so this is bytes per token
            "bytes_read_per_token": per(raw, "bytes_read", "tokens"),
            "mean_read_bytes": per(raw, "bytes_read", "reads_issued"),
            "reads_per_token": per(raw, "reads_issued", "tokens"),
            **{f"{name}_s": raw[f"{name}_ns"] / 1e9 for name in ("io_stall", "op", "checksum")}}


COMMON_STATS = COMMON_COUNTERS + tuple(common_derived(dict.fromkeys(COMMON_COUNTERS, 0)))


def derived_stats(raw: dict) -> dict:
    """The docs/design.md §5 metrics, defined once: every report uses this."""
    d = dict(raw, **common_derived(raw))
    d["loading_redundancy"] = per(raw, "bytes_unused", "bytes_computed")
    for name in ("predictor", "scorer"):
        d[f"{name}_s"] = raw[f"{name}_ns"] / 1e9
    d["bytes_computed_per_token"] = per(raw, "bytes_computed", "tokens")
    # speculation: share of the kept blocks that the layer-ahead prediction had prefetched
    d["spec_recall"] = per(raw, "spec_hits", "spec_selected", None)
    # read planning: I/O worker CPU per read
    d["io_cpu_us_per_read"] = raw["io_cpu_ns"] / 1e3 / raw["reads_issued"] if raw["reads_issued"] else 0.0
    return d


def kept_blocks(n_blocks: int, sparsity: float) -> int:
    """How many of a layer's n_blocks a sparse op computes at this sparsity: the engine's own
    rule (ls_kept_blocks), which the converter's training uses too."""
    return int(lib.ls_kept_blocks(int(n_blocks), float(sparsity)))


def candidate_blocks(n_blocks: int, sparsity: float, candidate_ratio: float) -> int:
    """Candidates of leanstream's exact-input selection (ls_candidate_blocks)."""
    return int(lib.ls_candidate_blocks(int(n_blocks), float(sparsity), float(candidate_ratio)))


_FAULTS = {"eio": lib.LS_FAULT_EIO, "short": lib.LS_FAULT_SHORT, "corrupt": lib.LS_FAULT_CORRUPT}
_HOOK_FIELDS = [name for name, _ in ffi.typeof("ls_test_hooks").fields]


def _test_hooks(hooks: dict | None):
    """This engine's ls_test_hooks (NULL: none), from its ``test_hooks`` keyword alone: the library
    holds no test state, and reads none from the environment (a test that runs an engine in
    another process wraps its creation there: tests/support/engine_hooks.py). Keys: the struct's
    fields (io_delay_us, io_queue_cap, io_queue_start, buffered_io, fault: "eio", "short" or
    "corrupt", fault_read: which read)."""
    if not hooks:
        return ffi.NULL
    bad = sorted(set(hooks) - set(_HOOK_FIELDS))
    if bad:
        raise TypeError(f"unknown test hook(s) {', '.join(bad)}")
    if hooks.get("fault") not in (None, *_FAULTS):
        raise ValueError(f"test hook fault must be one of {', '.join(_FAULTS)}, got {hooks['fault']!r}")
    h = ffi.new("ls_test_hooks *")
    for name, value in hooks.items():
        setattr(h, name, _FAULTS[value] if name == "fault" else int(value))
    return h


class NativeOwner:
    """The one Python owner of a native engine object (FFNEngine: an ls_engine, MoEEngine: an
    ls_moe): ``handle`` (ValueError once closed), ``address``, close() (also on leaving ``with``
    and on collection) and raise_pending. A subclass names its object's free and take_error.

    What every engine answers alike, for callers that do not know the model's kind (the commands,
    the tools): ``memory_budget`` (bytes it may keep in RAM, 0: no limit), ``params`` (its numeric
    parameters with the defaults resolved, by their C names), ``stats(layer)`` (COMMON_STATS, then
    the engine's OWN_STATS) and reset_stats()."""

    OWN_STATS: tuple[str, ...] = ()   # the fields of stats() beyond COMMON_STATS
    _handle = None       # set once the native object exists; close() and __del__ rely on it
    _free = None         # staticmethod(lib.ls_*_free)
    _take_error = None   # staticmethod(lib.ls_*_take_error)

    @property
    def handle(self):
        if self._handle is None:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._handle

    @property
    def address(self) -> int:
        """The native object's pointer as an integer (the user data of its llama.cpp builder)."""
        return int(ffi.cast("uintptr_t", self.handle))

    def close(self) -> None:
        if self._handle is not None:
            self._free(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def _query(self, fn, ctype: str, il: int) -> dict:
        """fn(handle, il, out) into a new ``ctype`` struct (layer info, counters): its fields."""
        out = ffi.new(ctype + " *")
        check(fn(self.handle, il, out))
        return {f: getattr(out, f) for f, _ in ffi.typeof(ctype).fields}

    def raise_pending(self) -> None:
        """Raise the error an I/O worker or the op (a graph's) recorded since the last check, if any."""
        buf = ffi.new("char[]", lib.LS_MAX_ERRMSG)
        st = self._take_error(self.handle, buf, lib.LS_MAX_ERRMSG)
        if st != lib.LS_OK:
            raise LeanstreamError(st, ffi.string(buf).decode(errors="replace"))


class FFNEngine(NativeOwner):
    """Streams and computes the FFN layers of one converted model directory.

    ``**tunable``: the engine's numeric parameters by their ls_engine_params names
    (TUNABLE_PARAMS: n_io_threads, max_read_bytes, sparsity, hot_fraction, candidate_ratio,
    bridge_bytes); None or absent takes the engine's default (ls_engine_params_init and the mode
    table), as do mode and verify_checksums. ``test_hooks``: for tests only (this engine's
    ls_test_hooks; see _test_hooks)."""

    _free = staticmethod(lib.ls_engine_free)
    _take_error = staticmethod(lib.ls_engine_take_error)
    # ls_stats beyond the common counters, what derived_stats adds, and "controller" (a policy
    # installed: its actions and decisions)
    OWN_STATS = (*(k for k in derived_stats(dict.fromkeys(STAT_FIELDS, 0)) if k not in COMMON_STATS),
                 "controller")
    controller = None  # the installed controller policy (set_controller), None: off

    def __init__(self, block_paths: Sequence[str | Path], *, activation: str = "silu",
                 memory_budget: int | None = None, mode: str | None = None,
                 predictor_paths: Sequence[str | Path | None] | None = None,
                 sketch_paths: Sequence[str | Path | None] | None = None, block_rank: np.ndarray | None = None,
                 verify_checksums: bool | None = None, test_hooks: dict | None = None, **tunable):
        unknown = sorted(set(tunable) - set(TUNABLE_PARAMS))
        if unknown:
            raise TypeError(f"unknown engine parameter(s) {', '.join(unknown)}; the engine's are "
                            f"{', '.join(TUNABLE_PARAMS)}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r}")
        self._handle = None
        self._keep_alive = []   # cffi buffers the engine's parameters point into
        self.n_layers = len(block_paths)
        self._paths = [ffi.new("char[]", str(p).encode()) for p in block_paths]
        self._path_array = ffi.new("const char *[]", self._paths)
        p = ffi.new("ls_engine_params *")
        lib.ls_engine_params_init(p)
        p.n_layers = self.n_layers
        p.block_paths = self._path_array
        p.activation = ACTIVATIONS[activation]
        if mode is not None:
            p.mode = mode_id(mode)
        p.memory_budget = budget_bytes(memory_budget)
        if verify_checksums is not None:
            p.verify_checksums = 1 if verify_checksums else 0
        for name, value in tunable.items():
            if value is not None:
                setattr(p, name, value)
        p.predictor_paths = self._layer_paths(predictor_paths, "predictor")
        p.sketch_paths = self._layer_paths(sketch_paths, "sketch")
        if block_rank is not None:
            self._rank = np.ascontiguousarray(block_rank, dtype=np.float32).reshape(-1)
            p.block_rank = ffi.cast("const float *", self._rank.ctypes.data)
        hooks = _test_hooks(test_hooks)   # (copied by the engine)
        p.test_hooks = hooks
        out = ffi.new("ls_engine **")
        check(lib.ls_engine_create(p, out), "cannot open the model's FFN block files")
        self._handle = out[0]
        self.mode = MODES[p.mode]
        self.memory_budget = p.memory_budget
        # what the engine made of the defaults (the mode's sparsity, hot set share, ...)
        got = ffi.new("ls_engine_params *")
        check(lib.ls_engine_get_params(self._handle, got))
        self.params = {name: getattr(got, name) for name in TUNABLE_PARAMS}
        given = tunable.get("sparsity")
        self.sparsity = float(given) if given is not None else float(got.sparsity)
        self.hot_fraction, self.candidate_ratio = float(got.hot_fraction), float(got.candidate_ratio)

    def _layer_paths(self, paths, what: str):
        """A const char *[n_layers] for the engine (NULL entries: none), kept alive by self; NULL if
        paths is None."""
        if paths is None:
            return ffi.NULL
        if len(paths) != self.n_layers:
            raise ValueError(f"{len(paths)} {what} paths for {self.n_layers} layers")
        keep = [ffi.new("char[]", str(q).encode()) if q else ffi.NULL for q in paths]
        arr = ffi.new("const char *[]", keep)
        self._keep_alive += [keep, arr]
        return arr

    # -- builders (ownership, errors: NativeOwner) -------------------------------------------
    @staticmethod
    def builder_address() -> int:
        """Address of ls_ffn_build, the llama_ffn_builder_t for llama_set_ffn_builder."""
        return int(ffi.cast("uintptr_t", lib.ls_ffn_build))

    @staticmethod
    def output_builder_address() -> int:
        """Address of ls_output_build, the llama_output_builder_t for llama_set_output_builder."""
        return int(ffi.cast("uintptr_t", lib.ls_output_build))

    # -- compute ---------------------------------------------------------------------------
    def layer_info(self, il: int) -> dict:
        """Layer il's geometry (ls_layer_info: n_embd, n_ff, neurons_per_block, n_blocks, the types,
        block_stride, block_payload, data_offset, split_layout)."""
        return self._query(lib.ls_engine_layer_info, "ls_layer_info", il)

    def eval_layer(self, il: int, x: np.ndarray, n_threads: int = 1, x_res: np.ndarray | None = None) -> np.ndarray:
        """FFN of layer il on x [n_tokens, n_embd] (f32), computed by the native op. x_res
        [n_embd]: the residual entering the FFN (what sparse modes feed their predictors)."""
        return self.eval_layers(il, 1, x, n_threads, x_res)

    def eval_layers(self, il0: int, n_layers: int, x: np.ndarray, n_threads: int = 1,
                    x_res: np.ndarray | None = None) -> np.ndarray:
        """Layers il0 .. il0 + n_layers - 1 one after another on the same threads, each on x
        (benchmarks: a decode token through the FFNs, no thread start per layer); the last output."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim == 1:
            x = x[None, :]
        y = np.empty_like(x)
        res = ffi.NULL
        if x_res is not None:
            x_res = np.ascontiguousarray(x_res, dtype=np.float32).reshape(-1)
            res = ffi.cast("const float *", x_res.ctypes.data)
        check(lib.ls_ffn_eval_layers(self.handle, il0, n_layers, ffi.cast("const float *", x.ctypes.data), res,
                                     ffi.cast("float *", y.ctypes.data), x.shape[0], n_threads))
        return y

    def set_draft(self, on: bool, fraction: float = 1.0) -> None:
        """Speculative decoding's draft FFN: while on, ops compute only resident blocks (of each
        layer's best-ranked ``fraction``) and read nothing."""
        check(lib.ls_engine_set_draft(self.handle, 1 if on else 0, float(fraction)))

    def set_draft_vocab(self, ids) -> None:
        """The token ids the draft's output projection computes (empty: every token)."""
        ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int32).reshape(-1))
        check(lib.ls_engine_set_draft_vocab(self.handle, ffi.cast("const int32_t *", ids.ctypes.data), ids.size))

    def draft_top(self, row: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The last draft op's best k (<= DRAFT_TOP) tokens of output row ``row`` (best first) and
        their probabilities over the draft vocabulary; empty where the last head op was not the
        draft's or had no such row. Only the head op sets them: a decode whose graph has llama.cpp's
        own head (patches/0004 declines with LoRA adapters or an output scale) leaves them as
        they were."""
        ids = np.empty(k, dtype=np.int32)
        probs = np.empty(k, dtype=np.float32)
        n = lib.ls_engine_draft_top(self.handle, row, ffi.cast("int32_t *", ids.ctypes.data),
                                    ffi.cast("float *", probs.ctypes.data), k)
        return ids[:n], probs[:n]

    def set_priorities(self, il: int, prio: np.ndarray) -> None:
        """Priorities of layer il's blocks for its next decode op (oracle / external scheduler)."""
        prio = np.ascontiguousarray(prio, dtype=np.float32)
        check(lib.ls_engine_set_priorities(self.handle, il, ffi.cast("const float *", prio.ctypes.data), prio.size))

    def last_plan(self, il: int) -> np.ndarray:
        """Blocks layer il's last op computed, in compute order."""
        n = lib.ls_engine_last_plan(self.handle, il, ffi.NULL, 0)
        out = np.empty(n, dtype=np.int32)
        lib.ls_engine_last_plan(self.handle, il, ffi.cast("int32_t *", out.ctypes.data), n)
        return out

    def last_candidates(self, il: int) -> np.ndarray:
        """Candidates of layer il's last exact-input (cascade) op: blocks whose gate/up were computed."""
        n = lib.ls_engine_last_candidates(self.handle, il, ffi.NULL, 0)
        out = np.empty(n, dtype=np.int32)
        lib.ls_engine_last_candidates(self.handle, il, ffi.cast("int32_t *", out.ctypes.data), n)
        return out

    def sketch_scores(self, il: int, x: np.ndarray) -> np.ndarray:
        """The sketch's score of every block of layer il for FFN input x [n_embd]."""
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        n = self.layer_info(il)["n_blocks"]
        out = np.empty(n, dtype=np.float32)
        check(lib.ls_engine_sketch_scores(self.handle, il, ffi.cast("const float *", x.ctypes.data),
                                          ffi.cast("float *", out.ctypes.data), n))
        return out

    def resident(self, il: int) -> np.ndarray:
        """bool [n_blocks]: which blocks of layer il are in the weight cache."""
        n = self.layer_info(il)["n_blocks"]
        out = np.zeros(n, dtype=np.uint8)
        check(lib.ls_engine_resident(self.handle, il, ffi.cast("uint8_t *", out.ctypes.data), n))
        return out.astype(bool)

    def set_hot_blocks(self, il: int, blocks: np.ndarray) -> None:
        """powerinfer2: blocks of layer il kept resident once loaded."""
        blocks = np.ascontiguousarray(blocks, dtype=np.int32)
        check(lib.ls_engine_set_hot_blocks(self.handle, il, ffi.cast("const int32_t *", blocks.ctypes.data), blocks.size))

    def set_capture(self, il: int, h: np.ndarray | None) -> None:
        """The converter's profile: while set, layer il's dense ops write act(gate)*up of every
        neuron into h (f32 [rows, n_blocks*k], C-contiguous, by slot) for their first rows token
        rows. The engine keeps a reference to h until it is unset (None)."""
        captures = self.__dict__.setdefault("_captures", {})
        if h is None:
            check(lib.ls_engine_set_capture(self.handle, il, ffi.NULL, 0))
            captures.pop(il, None)
            return
        info = self.layer_info(il)
        n_slots = info["n_blocks"] * info["neurons_per_block"]
        if h.dtype != np.float32 or h.ndim != 2 or h.shape[1] != n_slots or not h.flags.c_contiguous or not h.flags.writeable:
            raise ValueError(f"capture of layer {il}: a writable C-contiguous float32 [rows, {n_slots}] array, "
                             f"got {h.dtype} {h.shape}")
        check(lib.ls_engine_set_capture(self.handle, il, ffi.cast("float *", h.ctypes.data), h.shape[0]))
        captures[il] = h

    def capture_rows(self, il: int) -> int:
        """Token rows layer il's last op wrote to its capture."""
        return int(lib.ls_engine_capture_rows(self.handle, il))

    # -- streaming controller (control.py) ------------------------------------------------
    def set_controller(self, mode: str = "off", **policy) -> None:
        """Installs a controller policy (control.native_policy's arguments): "off" (the parameters
        as given), "fixed" (actions[fixed_action] everywhere), "table" or "profile" (random actions,
        recorded)."""
        from leanstream_ggml.native.control import native_policy

        p, keep = native_policy(mode, **policy)
        check(lib.ls_engine_set_controller(self.handle, p), "cannot install the controller")
        n = p.n_actions if mode != "off" else 0
        self.controller = {"mode": mode, "actions": [tuple(a) for a in policy.get("actions", ())][:n]}
        del keep

    def controller_samples(self) -> dict[str, np.ndarray]:
        """The ops the controller recorded since the last call (control.SAMPLE_FIELDS as arrays)."""
        from leanstream_ggml.native.control import SAMPLE_FIELDS

        cap = 4096
        buf = ffi.new("ls_ctrl_sample[]", cap)
        dropped = ffi.new("uint64_t *")
        rows = []
        while True:
            n = lib.ls_engine_ctrl_samples(self.handle, buf, cap, dropped)
            rows += [tuple(getattr(buf[i], f) for f in SAMPLE_FIELDS) for i in range(n)]
            if n < cap:
                break
        self.controller_dropped = int(dropped[0])
        cols = list(zip(*rows)) if rows else [()] * len(SAMPLE_FIELDS)
        return {f: np.asarray(c, dtype=np.float64 if f == "disk_ns_per_mib" else np.int64)
                for f, c in zip(SAMPLE_FIELDS, cols)}

    def controller_decisions(self) -> list[int]:
        """How many ops took each action since the policy was installed."""
        n = len(getattr(self, "controller", {}).get("actions", ()))
        out = ffi.new("uint64_t[]", max(n, 1))
        check(lib.ls_engine_ctrl_decisions(self.handle, out, n))
        return [int(out[i]) for i in range(n)]

    # -- counters --------------------------------------------------------------------------
    def stats(self, layer: int | None = None) -> dict:
        d = derived_stats(self._query(lib.ls_engine_stats, "ls_stats", -1 if layer is None else layer))
        ctrl = getattr(self, "controller", None)
        if ctrl and ctrl["mode"] != "off" and layer is None:
            d["controller"] = {"mode": ctrl["mode"], "actions": ctrl["actions"],
                               "decisions": self.controller_decisions(),
                               "ns_per_decision": d["ctrl_ns"] / d["ctrl_decisions"] if d["ctrl_decisions"] else 0.0}
        return d

    def reset_stats(self) -> None:
        lib.ls_engine_reset_stats(self.handle)


# -- what the native library runs on here (for reports: the tools' machine description) ---------
def kernel_isa() -> str:
    """The instruction set the engine's kernels dispatch to on this CPU (ls_kernel_isa)."""
    return ffi.string(lib.ls_kernel_isa()).decode()


def ggml_cpu_variant() -> str:
    """The CPU backend variant llama.cpp runs here: haswell, zen4, ... (ls_ggml_cpu_variant)."""
    return ffi.string(lib.ls_ggml_cpu_variant()).decode()
