"""MoEEngine: the Python owner of one native ``ls_moe`` (a model's expert files, the cache of
experts shared by its layers, its reader: the blocks' one cache and reader, native/src/cache.c and
io.c). The files' format: docs/formats.md "Expert file"; the writer is the converter's
(leanstream_convert/experts.py), the engine reads them itself (native/src/blockfile.c, the header
reader of block and expert files), `leanstream verify` through blockfile.read_expert_header.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from leanstream_ggml.native._native import check, ffi, lib
from leanstream_ggml.native.engine import (ACTIVATIONS, COMMON_STATS, NativeOwner, _test_hooks, common_derived,
                                           budget_bytes, per)

COUNTER_FIELDS = [name for name, _ in ffi.typeof("ls_moe_counters").fields]
# the numbers of ls_moe_params left to the engine's defaults unless given (params); the others are
# MoEEngine's own arguments
TUNABLE_PARAMS = tuple(name for name, _ in ffi.typeof("ls_moe_params").fields
                       if name not in {"n_layer", "memory_budget", "activation", "verify_checksums", "test_hooks",
                                       "read_ahead", "evict", "act_alpha", "act_limit", "weight_before"})
# a MoE expert's gated activation (build_moe_ffn's type_op; SwiGLU-OAI's alpha and limit are
# ls_moe_params_init's, llama.cpp's constants)
EXPERT_ACTIVATIONS = {**ACTIVATIONS, "relu": lib.LS_ACT_RELU, "swiglu_oai": lib.LS_ACT_SWIGLU_OAI}
# the share of a MoE model's expert cache pinned for the experts routed to most often in calibration
# (hot_fraction's default there): none, LFU with the calibration's counts as its prior keeps more
# (replayed on routing traces of the calibrated 48- and 16-layer shapes: bench/replay_experts.py,
# docs/design.md §24)
MOE_HOT_FRACTION = 0.0   # (backend.Experts pins; options.py shows it)
# LFU's prior: the routing pass's frequencies as the counts of this many tokens (the replay's
# calibration length)
MOE_PRIOR_TOKENS = 512
READ_AHEAD = {"off": lib.LS_AHEAD_OFF, "auto": lib.LS_AHEAD_AUTO, "on": lib.LS_AHEAD_ON}
EVICT = {"lfu": lib.LS_EVICT_LFU, "lru": lib.LS_EVICT_LRU}


def derived_counters(raw: dict) -> dict:
    """The MoE op's counters in the words every engine's stats() shares (engine.COMMON_STATS: an
    expert is a block; its reads are the misses, the hot set's loads and read-ahead; the op's time is its
    thread 0's, waiting and computing; nothing is resident besides the cache), then its own
    (routed, experts, hits, misses, ...) with what is derived from them."""
    slot_bytes = raw["slot_bytes"]
    common = {"op_calls": raw["op_calls"], "tokens": raw["tokens"], "blocks_computed": raw["experts"],
              "blocks_read": raw["misses"] + raw["pin_loads"] + raw["ahead_reads"], "bytes_read": raw["bytes_read"],
              "reads_issued": raw["reads"], "io_stall_ns": raw["stall_ns"],
              "op_ns": raw["stall_ns"] + raw["compute_ns"], "checksum_ns": raw["checksum_ns"],
              "cache_bytes": raw["resident"] * slot_bytes,
              "cache_capacity": raw["cache_slots"] * slot_bytes, "hot_blocks": raw["pinned"], "resident_bytes": 0,
              "direct_io": raw["direct_io"]}
    own = {k: v for k, v in raw.items() if k not in common}
    return {**common, **common_derived(common), **own, "hit_ratio": per(raw, "hits", "experts"),
            "stall_s": raw["stall_ns"] / 1e9, "compute_s": raw["compute_ns"] / 1e9,
            "ahead_recall": per(raw, "ahead_predicted", "ahead_routed"),
            "ahead_precision": per(raw, "ahead_useful", "ahead_candidates"),
            "ahead_wasted_bytes": max(0, raw["ahead_reads"] - raw["ahead_used"]) * slot_bytes}


class MoEEngine(NativeOwner):
    """Streams and computes the routed experts of a model's MoE layers from their expert files.

    expert_paths: [n_layer] the expert file of each layer (None: a layer without experts).
    memory_budget: bytes of the expert cache for all layers together (None/0: every expert).
    activation: the experts' gated activation (EXPERT_ACTIVATIONS); weight_before: the router's
    weights scale each expert's input rather than its output (llama4).
    read_ahead: "off" (default), "auto" (each layer's predicted experts read while the layer
    before it computes, turned off per layer while too few are used) or "on". evict: which cached
    expert gives way, "lfu" (default: the one used least, from the prior set_uses gives) or "lru".
    n_io_threads,
    max_read_bytes, verify_checksums, ahead_min_precision, ahead_max_tokens, ahead_top: None takes the
    engine's default (ls_moe_params_init). ``test_hooks``: tests only (FFNEngine's keys)."""

    _free = staticmethod(lib.ls_moe_free)
    _take_error = staticmethod(lib.ls_moe_take_error)
    OWN_STATS = tuple(k for k in derived_counters(dict.fromkeys(COUNTER_FIELDS, 0)) if k not in COMMON_STATS)

    def __init__(self, expert_paths: Sequence[str | Path | None], *, memory_budget: int | None = None,
                 activation: str = "silu", weight_before: bool = False, n_io_threads: int | None = None, max_read_bytes: int | None = None,
                 verify_checksums: bool | None = None, read_ahead: str = "off",
                 ahead_min_precision: float | None = None, ahead_max_tokens: int | None = None,
                 ahead_top: int | None = None, evict: str = "lfu", test_hooks: dict | None = None):
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r} (known: {', '.join(EXPERT_ACTIVATIONS)})")
        if read_ahead not in READ_AHEAD:
            raise ValueError(f"read_ahead={read_ahead!r}: one of {', '.join(READ_AHEAD)}")
        if evict not in EVICT:
            raise ValueError(f"evict={evict!r}: one of {', '.join(EVICT)}")
        self.n_layer = len(expert_paths)
        self.memory_budget = budget_bytes(memory_budget)   # bytes of the expert cache (0: every expert)
        self._paths = [ffi.new("char[]", str(p).encode()) if p else ffi.NULL for p in expert_paths]
        self._path_array = ffi.new("const char *[]", self._paths)
        p = ffi.new("ls_moe_params *")
        lib.ls_moe_params_init(p)
        p.n_layer = self.n_layer
        p.memory_budget = self.memory_budget
        p.activation = EXPERT_ACTIVATIONS[activation]
        p.weight_before = 1 if weight_before else 0
        if verify_checksums is not None:
            p.verify_checksums = 1 if verify_checksums else 0
        p.read_ahead = READ_AHEAD[read_ahead]
        p.evict = EVICT[evict]
        given = {"n_io_threads": n_io_threads, "max_read_bytes": max_read_bytes, "ahead_top": ahead_top,
                 "ahead_min_precision": ahead_min_precision, "ahead_max_tokens": ahead_max_tokens}
        for name, value in given.items():   # the others: ls_moe_params_init's defaults
            if value is not None:
                setattr(p, name, value)
        hooks = _test_hooks(test_hooks)   # (copied by the engine)
        p.test_hooks = hooks
        out = ffi.new("ls_moe **")
        check(lib.ls_moe_create(p, self._path_array, out), "cannot open the model's expert files")
        self._handle = out[0]
        self.params = {name: getattr(p, name) for name in TUNABLE_PARAMS}   # (ls_moe_params_init's defaults)

    # -- the builder (ownership, errors: NativeOwner) ----------------------------------------
    @staticmethod
    def builder_address() -> int:
        """Address of ls_moe_build, the builder llama.cpp's MoE hook calls per layer."""
        return int(ffi.cast("uintptr_t", lib.ls_moe_build))

    # -- layers, the hot set, compute ----------------------------------------------------------
    def layer_info(self, il: int) -> dict:
        """Layer il's geometry (n_embd, n_ff_exp, n_expert, the types, expert_stride)."""
        return self._query(lib.ls_moe_layer_info, "ls_moe_info", il)

    def pin(self, il: int, experts) -> None:
        """Layer il's hot set: these experts (router indices) read now and kept resident,
        replacing its previous hot set (empty: none)."""
        experts = np.ascontiguousarray(np.asarray(experts, dtype=np.int32).reshape(-1))
        check(lib.ls_moe_pin(self.handle, il, ffi.cast("const int32_t *", experts.ctypes.data), experts.size),
              f"cannot pin layer {il}'s experts")

    def set_router(self, il: int, router: np.ndarray, n_used: int) -> None:
        """Layer il's router [n_expert, n_embd] (read-ahead's predictions of its experts; in a graph
        the engine finds llama.cpp's own): its top n_used of router . x."""
        router = np.ascontiguousarray(router, dtype=np.float32)
        check(lib.ls_moe_set_router(self.handle, il, ffi.cast("const float *", router.ctypes.data), router.shape[0],
                                    router.shape[1], n_used), f"cannot set layer {il}'s router")

    def set_uses(self, il: int, uses) -> None:
        """LFU's prior of layer il: uses [n_expert] by router index (the conversion's routing
        counts), replacing what its experts counted so far."""
        uses = np.ascontiguousarray(np.clip(np.asarray(uses), 0, 2**32 - 1), dtype=np.uint32).reshape(-1)
        check(lib.ls_moe_set_uses(self.handle, il, ffi.cast("const uint32_t *", uses.ctypes.data), uses.size),
              f"cannot set layer {il}'s expert uses")

    def routing_counts(self, il: int) -> np.ndarray:
        """[n_expert] token-expert pairs layer il routed to each expert (since made or reset_stats)."""
        n = self.layer_info(il)["n_expert"]
        out = np.zeros(n, np.uint64)
        check(lib.ls_moe_routing_counts(self.handle, il, ffi.cast("uint64_t *", out.ctypes.data), n))
        return out

    def eval(self, il: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, n_threads: int = 1) -> np.ndarray:
        """Layer il's routed experts of x [n_tokens, n_embd] f32: ids [n_tokens, n_used] router
        indices, weights [n_tokens, n_used] f32; returns y [n_tokens, n_embd] (the graph op's math)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim == 1:
            x = x[None, :]
        ids = np.ascontiguousarray(ids, dtype=np.int32).reshape(x.shape[0], -1)
        weights = np.ascontiguousarray(weights, dtype=np.float32).reshape(ids.shape)
        n_embd = self.layer_info(il)["n_embd"]
        if x.shape[1] != n_embd:
            raise ValueError(f"layer {il}: x has rows of {x.shape[1]} values, the experts take {n_embd}")
        y = np.empty_like(x)
        check(lib.ls_moe_eval(self.handle, il, ffi.cast("const float *", x.ctypes.data), x.shape[0],
                              ffi.cast("const int32_t *", ids.ctypes.data), ffi.cast("const float *", weights.ctypes.data),
                              ids.shape[1], ffi.cast("float *", y.ctypes.data), n_threads))
        return y

    # -- counters --------------------------------------------------------------------------
    def stats(self, il: int | None = None) -> dict:
        """Counters of layer il (None: summed over layers): engine.COMMON_STATS, then OWN_STATS
        (derived_counters)."""
        return derived_counters(self._query(lib.ls_moe_stats, "ls_moe_counters", -1 if il is None else il))

    def reset_stats(self) -> None:
        lib.ls_moe_reset_stats(self.handle)
