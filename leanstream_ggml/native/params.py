"""The engine's user-facing parameters, validated once, at the boundary.

options.py declares the options (the table); this module owns their checks (``CHECKS``, one per
option) and the rules between them, and reads the table, never the other way round. ``Llama``,
``leanstream chat``, ``serve`` and the tools pass what the user gave through ``llama_options``
(every Llama option) or ``engine_params`` (the FFN engine's); each value is checked and
normalized, and a bad one raises ``ParameterError`` naming the parameter. The native engine
re-checks its inputs (it never trusts its caller), but messages for people come from here.

    engine_params(memory_budget="512MiB", mode="leanstream", n_io_threads=8)
    -> {"memory_budget": 536870912, "mode": "leanstream", "sparsity": None, "n_io_threads": 8, ...}

A value left at None takes the option's default (options.py), and where that is None the
engine's own (ls_engine_params_init and the mode table in native/src/mode.c are the one place
those are written).
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import re

from leanstream_ggml.options import Settings

MAX_BYTES = (1 << 63) - 1       # the engine's budget is a u64; anything near it is a typo

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
UNLIMITED = ("", "0", "none", "unlimited", "inf")


class ParameterError(ValueError):
    """A parameter value is out of range or of the wrong type; ``name`` says which."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.name = name


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def size_bytes(value, name: str = "memory_budget") -> int:
    """Bytes from 123, "512MiB" (2^20), "1.5GB" (10^9), "800 k"; None, 0, "none" and "unlimited"
    mean 0 (no limit). Fractions of a byte, negatives, NaN, infinities and sizes of 2^63 or
    more are refused."""
    if value is None:
        return 0
    if isinstance(value, bool):
        raise ParameterError(name, f"expected a size in bytes (an int or a string like '512MiB'), got {value!r}")
    if _is_int(value):
        n = int(value)
    elif _is_real(value):
        f = float(value)
        if not math.isfinite(f):
            raise ParameterError(name, f"must be a finite size in bytes, got {value!r}")
        if f != int(f):
            raise ParameterError(name, f"must be a whole number of bytes, got {value!r}")
        n = int(f)
    elif isinstance(value, str):
        s = value.strip().lower()
        if s in UNLIMITED:
            return 0
        m = _SIZE_RE.match(s)
        if not m or m.group(2) not in _UNITS:
            raise ParameterError(name, f"cannot parse {value!r} as a size (examples: 512MiB, 1.5GB, 800000000, "
                                       f"unlimited)")
        num, unit = m.group(1), _UNITS[m.group(2)]
        if "." in num:
            whole, frac = num.split(".")
            n_exact = int(whole or "0") * unit + int(frac or "0") * unit / 10 ** len(frac)
            n = int(n_exact)
            if n == 0:
                raise ParameterError(name, f"{value!r} is less than one byte (use 0 or 'unlimited' for no limit)")
        else:
            n = int(num) * unit
    else:
        raise ParameterError(name, f"expected a size in bytes (an int or a string like '512MiB'), "
                                   f"got {type(value).__name__}")
    if n < 0:
        raise ParameterError(name, f"must be >= 0, got {value!r}")
    if n > MAX_BYTES:
        raise ParameterError(name, f"{value!r} is too large (at most 2^63 - 1 bytes)")
    return n


def _int_in(value, name: str, lo: int, hi: int) -> int:
    if not _is_int(value):
        raise ParameterError(name, f"must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= int(value) <= hi:
        raise ParameterError(name, f"must be in [{lo}, {hi}], got {value!r}")
    return int(value)


def _real_in(value, name: str, lo: float, hi: float, hi_open: bool) -> float:
    if not _is_real(value):
        raise ParameterError(name, f"must be a number, got {value!r}")
    f = float(value)
    if not (math.isfinite(f) and lo <= f and (f < hi if hi_open else f <= hi)):
        raise ParameterError(name, f"must be in [{lo:g}, {hi:g}{')' if hi_open else ']'}, got {value!r}")
    return f


# This module and options.py load no native library until a value is checked against the engine
# (its modes, its thread limit): `leanstream convert` builds info's --memory-limit from them.

def _default(name: str):
    from leanstream_ggml.options import BY_NAME

    return BY_NAME[name].default


def max_n_io_threads() -> int:
    from leanstream_ggml.native._native import lib

    return lib.LS_MAX_IO_THREADS


def mode(value) -> str:
    from leanstream_ggml.native import modes

    if not isinstance(value, str) or value not in modes.MODES:
        raise ParameterError("mode", f"unknown mode {value!r}; choose one of {', '.join(modes.MODES)}")
    return value


def sparsity(value) -> float:
    return _real_in(value, "sparsity", 0.0, 1.0, hi_open=True)


def n_io_threads(value) -> int:
    return _int_in(value, "n_io_threads", 1, max_n_io_threads())


def hot_fraction(value) -> float:
    return _real_in(value, "hot_fraction", 0.0, 1.0, hi_open=False)


def candidate_ratio(value) -> float:
    return _real_in(value, "candidate_ratio", 1.0, 1000.0, hi_open=False)


def bridge_bytes(value) -> int:
    return _int_in(value, "bridge_bytes", 0, 1 << 30)


_QUALITY_RE = re.compile(r"^\s*ppl\s*\+\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*$", re.IGNORECASE)


def quality(value) -> float:
    """"ppl+5%" -> 1.05: the largest perplexity ratio vs stock the user accepts."""
    m = _QUALITY_RE.match(value) if isinstance(value, str) else None
    if not m:
        raise ParameterError("quality", f"expected a perplexity budget like 'ppl+5%', got {value!r}")
    pct = float(m.group(1))
    if not 0.0 <= pct <= 1000.0:
        raise ParameterError("quality", f"the percentage must be in [0, 1000], got {value!r}")
    return 1.0 + pct / 100.0


def quality_preset(value) -> str:
    """quality= checked: the preset itself (``quality(value)`` is the ratio it allows)."""
    quality(value)
    return value


def sparsity_for_quality(table: list[dict], max_ppl_ratio: float) -> float:
    """The largest sparsity whose calibrated perplexity ratio (the converter's table: [{"sparsity",
    "ppl_ratio"}]) stays within max_ppl_ratio, linearly interpolated between calibrated points
    (sparsity 0 costs nothing). The curve is made monotone first (calibration noise)."""
    pts = [(0.0, 1.0)] + sorted((float(q["sparsity"]), float(q["ppl_ratio"])) for q in table)
    mono, worst = [], 1.0
    for s, r in pts:
        worst = max(worst, r)
        mono.append((s, worst))
    best = 0.0
    for (s0, r0), (s1, r1) in zip(mono, mono[1:]):
        if r1 <= max_ppl_ratio:
            best = s1
            continue
        if r0 <= max_ppl_ratio < r1:
            best = s0 + (s1 - s0) * (max_ppl_ratio - r0) / (r1 - r0)
        break
    return round(best, 3)


_CONTROLLER_RE = re.compile(r"^(off|table|fixed:[0-9]{1,2})$")


def controller(value) -> str:
    """The streaming controller: None (the default, off), "off", "table", or "fixed:K" (an action index)."""
    if value is None:
        return _default("controller")
    if not isinstance(value, str) or not _CONTROLLER_RE.match(value.strip()):
        raise ParameterError("controller", f"expected 'off', 'table' or 'fixed:K', got {value!r}")
    return value.strip()


def llama_options(given: dict) -> Settings:
    """Every Llama option (options.LLAMA) from the ones given: each checked (ParameterError naming
    the first bad one), the others at their defaults, then the rules between them: quality= picks
    the sparsity (not both) of the mode it implies, one that runs the sketch cascade; controller=
    steers only that cascade; speculative decoding verifies with the dense pass (a sparse mode:
    off); memory_limit= or memory_budget=, not both; sizes as bytes. Nothing is opened. The
    result is immutable: what a later step decides is a ``replace``d copy."""
    from leanstream_ggml.native import modes
    from leanstream_ggml.options import LLAMA

    unknown = set(given) - {o.name for o in LLAMA}
    if unknown:
        raise TypeError(f"not an option of Llama: {', '.join(sorted(unknown))}")
    v = {o.name: o.default if given.get(o.name) is None else CHECKS[o.name](given[o.name]) for o in LLAMA}
    if v["quality"] is not None:
        if v["sparsity"] is not None:
            raise ParameterError("quality", "give quality= or sparsity=, not both")
        if v["mode"] is not None and not modes.is_cascade(v["mode"]):
            raise ParameterError("quality", f"chooses {modes.QUALITY} mode's sparsity; mode={v['mode']!r} was given")
        v["mode"] = v["mode"] or modes.QUALITY
    v["mode"] = v["mode"] or modes.DEFAULT
    if v["controller"] != "off" and not modes.is_cascade(v["mode"]):
        raise ParameterError("controller", f"steers {modes.QUALITY} mode's decode; mode={v['mode']!r} was given")
    v["speculative"] = speculative(v["speculative"], v["mode"])
    if v["draft_stop"] is None:
        v["draft_stop"] = draft_stop(None)    # the default as the draft uses it
    if v["memory_limit"] and v["memory_budget"] is not None:
        raise ParameterError("memory_limit", "give memory_limit= (the whole process) or memory_budget= "
                                             "(the FFN engine), not both")
    return Settings(**v)


def engine_params(**given) -> dict:
    """The FFN engine's options (options.ENGINE: memory_budget, mode, sparsity, n_io_threads, ...)
    validated and normalized (raises ParameterError naming the bad one). None stays None (the
    engine's default)."""
    from leanstream_ggml.options import ENGINE

    unknown = set(given) - set(ENGINE)
    if unknown:
        raise TypeError(f"not an engine parameter: {', '.join(sorted(unknown))} (the engine's: {', '.join(ENGINE)})")
    v = llama_options(given)
    return {name: v[name] for name in ENGINE}


SPECULATIVE_KINDS = ("auto", "self", "ngram", "off")
MAX_DRAFT = 64


def speculative(value, mode: str | None = None) -> str:
    """speculative: None (the default: "auto"; docs/design.md §21), "auto" (self draft + prompt
    lookup in one tree, the controller choosing what to draft and verify; in a sparse mode "off"), "self",
    "ngram" or "off". Speculative decoding verifies with the dense pass, so a sparse mode refuses
    self and ngram (its answers would change). mode None: the value alone is checked."""
    from leanstream_ggml.native import modes

    v = _default("speculative") if value is None else value
    if not isinstance(v, str) or v not in SPECULATIVE_KINDS:
        raise ParameterError("speculative", f"expected one of {', '.join(SPECULATIVE_KINDS)}, got {value!r}")
    if mode is not None and modes.is_sparse(mode):
        if v in ("self", "ngram"):
            raise ParameterError("speculative", f"verifies drafts with the dense pass; mode={mode!r} decodes sparse "
                                                f"(use mode={modes.DEFAULT!r}, or speculative='off')")
        return "off"
    return v


def draft_max(value) -> int:
    return _default("draft_max") if value is None else _int_in(value, "draft_max", 1, MAX_DRAFT)


def draft_width(value) -> int:
    from leanstream_ggml.speculation.draft_control import MAX_RANK

    return _default("draft_width") if value is None else _int_in(value, "draft_width", 1, MAX_RANK)


def draft_fraction(value) -> float | None:
    if value is None:
        return _default("draft_fraction")
    f = _real_in(value, "draft_fraction", 0.0, 1.0, hi_open=False)
    if f <= 0.0:
        raise ParameterError("draft_fraction", f"must be in (0, 1], got {value!r}")
    return f


def draft_stop(value) -> tuple[str, float]:
    """draft_stop as the draft uses it, (rule, X): None or "controller" -> ("controller", 0.0)
    (the solved table and node selection), "fixed" -> ("fixed", 0.0) (always draft_max steps,
    every drafted token verified), "p_min:X" -> ("p_min", X) (llama.cpp's rule: stop when the
    draft's top-1 probability falls below X; every drafted token verified)."""
    if value is None or value == "controller":
        return "controller", 0.0
    if value == "fixed":
        return "fixed", 0.0
    if isinstance(value, str) and value.startswith("p_min:"):
        try:
            x = float(value.split(":", 1)[1])
        except ValueError:
            x = float("nan")
        if 0.0 <= x <= 1.0:
            return "p_min", x
    raise ParameterError("draft_stop", f"expected 'controller', 'fixed' or 'p_min:X' (0 <= X <= 1), got {value!r}")


def in_ram(value) -> str:
    if value not in ("auto", "stream"):
        raise ParameterError("in_ram", f"expected 'auto' or 'stream', got {value!r}")
    return value


def source(value) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.path.isfile(value):
        raise ParameterError("source", f"not a file: {value!r}")
    return os.fspath(value)


def expert_cache(value):
    if value not in ("lfu", "lru"):
        raise ParameterError("expert_cache", f"{value!r}: lfu or lru")
    return value


def read_ahead(value):
    if value not in ("auto", "on", "off"):
        raise ParameterError("read_ahead", f"{value!r}: auto, on or off")
    return value


# Each option's check, by the option's name (options.py declares the options; every one has a check
# here, tests/unit/test_options.py holds the two to each other): a given value (never None) ->
# the value Llama uses, or ParameterError naming the option.
CHECKS = {
    "memory_budget": functools.partial(size_bytes, name="memory_budget"),
    "memory_limit": functools.partial(size_bytes, name="memory_limit"),
    "mode": mode,
    "sparsity": sparsity,
    "quality": quality_preset,
    "n_io_threads": n_io_threads,
    "hot_fraction": hot_fraction,
    "candidate_ratio": candidate_ratio,
    "bridge_bytes": bridge_bytes,
    "verify_checksums": bool,
    "controller": controller,
    "read_ahead": read_ahead,
    "expert_cache": expert_cache,
    "speculative": speculative,
    "draft_max": draft_max,
    "draft_width": draft_width,
    "draft_fraction": draft_fraction,
    "draft_stop": draft_stop,
    "reuse_prefix": bool,
    "in_ram": in_ram,
    "source": source,
}
